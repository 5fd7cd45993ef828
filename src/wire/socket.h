// Thin, Status-returning wrappers over TCP sockets (IPv4 and IPv6). Every descriptor returned is
// close-on-exec. Thread-safe (no shared state).
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "base/clock.h"
#include "base/status.h"

namespace jaxtrain::wire {

struct HostPort {
  std::string host;
  int port = 0;
  std::string ToString() const;  // "host:port", brackets around an IPv6 host
};

// Parses "host:port" or "[v6]:port". Errors: kInvalidArgument naming the text.
StatusOr<HostPort> ParseHostPort(std::string_view text);

// A non-blocking listening socket on `host`:`port` (0 = any free port); `*bound_port` receives the
// port. Errors: kUnavailable when the address cannot be bound.
StatusOr<int> Listen(const std::string& host, int port, int* bound_port);

// A blocking connected socket with TCP_NODELAY, from the local address `source` (a numeric
// address; empty: the system's choice), its port chosen by the system. Errors: kUnavailable when
// the peer refuses or cannot be reached, kDeadlineExceeded when `timeout` passes first,
// kInvalidArgument when `source` is not a local address of the peer's family.
StatusOr<int> Connect(const HostPort& address, Duration timeout, const std::string& source = "");

// Writes all of `data` to a blocking socket. Errors: kUnavailable when the peer is gone.
Status WriteAll(int fd, std::string_view data);

// A port that was free on `host` a moment ago (bind to port 0, read it, close).
StatusOr<int> PickFreePort(const std::string& host);

void SetNonBlocking(int fd);

// TCP keepalive on a connected socket: a peer whose host vanishes without closing the connection
// (power loss, a network cut) is noticed after about 10 s without traffic; reads and writes then
// fail with ETIMEDOUT. With `unacked_limit`, also when data it was sent stays unacknowledged that
// long (TCP_USER_TIMEOUT; it counts a zero window too, so only for a peer that always reads).
void EnableKeepAlive(int fd, std::optional<Duration> unacked_limit = std::nullopt);

}  // namespace jaxtrain::wire
