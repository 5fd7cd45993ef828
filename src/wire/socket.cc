#include "wire/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <memory>

namespace jaxtrain::wire {
namespace {

struct AddrInfoDeleter {
  void operator()(addrinfo* ai) const { freeaddrinfo(ai); }
};

StatusOr<std::unique_ptr<addrinfo, AddrInfoDeleter>> Resolve(const std::string& host, int port,
                                                             bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* result = nullptr;
  std::string port_text = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints, &result);
  if (rc != 0) {
    return UnavailableError("cannot resolve host '" + host + "': " + gai_strerror(rc));
  }
  return std::unique_ptr<addrinfo, AddrInfoDeleter>(result);
}

// Binds `fd` to the local address `source` of `family`, its port left to connect() (so that the
// port is chosen for the 4-tuple, not reserved for the address alone).
Status BindSource(int fd, int family, const std::string& source) {
  const std::string what = "the source address '" + source + "'";
  int one = 1;
  setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
  sockaddr_storage addr{};
  socklen_t len = 0;
  if (family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&addr);
    in->sin_family = AF_INET;
    if (inet_pton(AF_INET, source.c_str(), &in->sin_addr) != 1) {
      return InvalidArgumentError(what + " is not an IPv4 address");
    }
    len = sizeof(sockaddr_in);
  } else {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&addr);
    in6->sin6_family = AF_INET6;
    if (inet_pton(AF_INET6, source.c_str(), &in6->sin6_addr) != 1) {
      return InvalidArgumentError(what + " is not an IPv6 address");
    }
    len = sizeof(sockaddr_in6);
  }
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    return InvalidArgumentError("cannot connect from " + what + ": " + std::strerror(errno));
  }
  return OkStatus();
}

}  // namespace

std::string HostPort::ToString() const {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

StatusOr<HostPort> ParseHostPort(std::string_view text) {
  auto bad = [&] {
    return InvalidArgumentError("address '" + std::string(text) +
                                "' is not host:port (e.g. 127.0.0.1:29500 or [::1]:29500)");
  };
  size_t colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0) return bad();
  std::string_view host = text.substr(0, colon);
  std::string_view port_text = text.substr(colon + 1);
  if (host.front() == '[') {
    if (host.back() != ']') return bad();
    host = host.substr(1, host.size() - 2);
  }
  int port = 0;
  auto [ptr, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || ptr != port_text.data() + port_text.size() || port <= 0 ||
      port > 65535 || host.empty()) {
    return bad();
  }
  return HostPort{std::string(host), port};
}

void SetNonBlocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

void EnableKeepAlive(int fd, std::optional<Duration> unacked_limit) {
  int one = 1, idle = 5, interval = 1, count = 5;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  if (unacked_limit) {
    unsigned ms = static_cast<unsigned>(
        std::chrono::duration_cast<std::chrono::milliseconds>(*unacked_limit).count());
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof(ms));
  }
}

StatusOr<int> Listen(const std::string& host, int port, int* bound_port) {
  JT_ASSIGN_OR_RETURN(auto ai, Resolve(host, port, /*passive=*/true));
  int last_errno = 0;
  for (addrinfo* a = ai.get(); a != nullptr; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 4096) == 0) {
      sockaddr_storage bound{};
      socklen_t len = sizeof(bound);
      getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
      *bound_port = bound.ss_family == AF_INET6
                        ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                        : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      return fd;
    }
    last_errno = errno;
    close(fd);
  }
  return UnavailableError("cannot listen on " + HostPort{host, port}.ToString() + ": " +
                          std::strerror(last_errno));
}

StatusOr<int> Connect(const HostPort& address, Duration timeout, const std::string& source) {
  JT_ASSIGN_OR_RETURN(auto ai, Resolve(address.host, address.port, /*passive=*/false));
  int last_errno = ECONNREFUSED;
  for (addrinfo* a = ai.get(); a != nullptr; a = a->ai_next) {
    int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    if (!source.empty()) {
      Status bound = BindSource(fd, a->ai_family, source);
      if (!bound.ok()) {
        close(fd);
        return bound;
      }
    }
    int rc = connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int ms =
          static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count());
      int n;
      do {
        n = poll(&p, 1, ms);
      } while (n < 0 && errno == EINTR);
      if (n == 0) {
        close(fd);
        return DeadlineExceededError("connecting to " + address.ToString() + " timed out");
      }
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc == 0) {
      fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      return fd;
    }
    last_errno = errno;
    close(fd);
  }
  return UnavailableError("cannot connect to " + address.ToString() + ": " +
                          std::strerror(last_errno));
}

Status WriteAll(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return UnavailableError(std::string("connection lost while sending: ") +
                              std::strerror(errno));
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return OkStatus();
}

StatusOr<int> PickFreePort(const std::string& host) {
  int port = 0;
  JT_ASSIGN_OR_RETURN(int fd, Listen(host, 0, &port));
  close(fd);
  return port;
}

}  // namespace jaxtrain::wire
