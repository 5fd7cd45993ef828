#include "controller/control_port.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <set>

#include "base/strings.h"
#include "wire/handshake.h"
#include "wire/out_queue.h"
#include "wire/socket.h"

namespace jaxtrain::controller {
namespace {

constexpr size_t kReadChunk = 64 << 10;
constexpr size_t kMaxRefusalText = 200;  // the reason in a kRefused frame
constexpr int kMaxReadyConns = 1024;     // connection events taken per call
constexpr int kMaxRefusalsSaid = 10;

std::string PeerName(const sockaddr_storage& addr) {
  char host[64] = "?";
  int port = 0;
  if (addr.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  }
  return wire::HostPort{host, port}.ToString();
}

// Whether a socket's error says its peer went silent: ETIMEDOUT once the listener's keepalive
// probes (or a send's retransmissions) went unanswered; the others when the network said the
// host or its network is gone (the keepalive reports the last such ICMP error instead).
bool TimedOut(int error) {
  return error == ETIMEDOUT || error == EHOSTUNREACH || error == ENETUNREACH || error == EHOSTDOWN;
}

// The port over TCP: one epoll set of every open connection.
class TcpControlPort final : public ControlPort {
 public:
  TcpControlPort(int listen_fd, int epoll_fd, std::string secret, const Clock& clock,
                 Duration handshake_timeout, Delegate& delegate);
  ~TcpControlPort() override;

  void BeginAttempt(int attempt, size_t world_size) override;
  int listen_fd() const override { return listen_fd_; }
  int ready_fd() const override { return epoll_fd_; }
  void OnConnsReady() override;
  void Accept() override;
  void ExpireHandshakes() override;
  std::optional<TimePoint> NextDeadline() override;
  void Sweep() override;
  bool connected(int rank) const override { return by_rank_[static_cast<size_t>(rank)] != nullptr; }
  void Send(int rank, wire::MessageType type, std::string_view body) override;
  void SendShared(int rank, const wire::SharedFrame& shared) override;
  void Read(int rank) override;
  void Close(int rank) override;
  int dropped() const override { return dropped_; }

 private:
  struct Conn {
    int fd = -1;
    std::string peer;
    wire::FrameDecoder decoder{wire::kHelloSize};
    wire::OutQueue out;
    // kHello: nothing valid received yet (unproven). kAuth: its hello was made with the secret
    // and answered. kAuthed: the connection is `rank`'s.
    enum class Stage { kHello, kAuth, kAuthed } stage = Stage::kHello;
    wire::Hello hello;
    wire::Nonce nonce{};
    // The connection's session (wire/frame.h), from its hello and challenge: every frame after
    // the auth, both ways, is sealed and opened here.
    wire::SealedFrames frames;
    TimePoint deadline;
    int rank = -1;
    bool closed = false;
    bool watching_out = false;  // EPOLLOUT is in its interest set
  };

  void DropOldestUnproven();
  void Refuse(Conn& c, const std::string& why, bool tell = false);
  // `timed_out`: why it closes (ControlPort::Delegate::OnClosed).
  void CloseConn(Conn& c, bool timed_out = false);
  void Flush(Conn& c);
  void ReadConn(Conn& c);
  void DecoderError(Conn& c, const Status& s);
  void OnFrame(Conn& c, const wire::FrameView& f);
  void OnHello(Conn& c, const wire::FrameView& f);
  void OnAuth(Conn& c, const wire::FrameView& f);
  const Conn* OldestHandshaking();

  const int listen_fd_;
  const int epoll_fd_;  // every open connection (data.ptr: its Conn): a wake costs O(ready)
  const std::string secret_;
  const Clock& clock_;
  const Duration handshake_timeout_;
  Delegate& delegate_;

  int attempt_ = 0;
  std::vector<std::unique_ptr<Conn>> conns_;
  std::vector<Conn*> by_rank_;   // the rank's authenticated connection, or null
  std::vector<Conn*> answered_;  // by rank: the connection whose hello was answered, until auth
  // Connections not yet authenticated, in accept order, which is their deadlines' order (the same
  // timeout from a monotonic clock); closed or authenticated ones are skipped.
  std::deque<Conn*> handshaking_;
  std::deque<Conn*> unproven_;  // Stage::kHello connections, oldest first; stale entries skipped
  size_t unproven_count_ = 0;   // the live ones among them
  std::set<wire::Nonce> hello_nonces_;  // of this attempt's answered hellos
  bool any_closed_ = false;             // a connection was closed since the last Sweep()
  int dropped_ = 0;
  int refusals_ = 0;  // of the whole run: only the first few are said
};

}  // namespace

StatusOr<std::unique_ptr<ControlPort>> ControlPort::Create(int listen_fd, std::string secret,
                                                           const Clock& clock,
                                                           Duration handshake_timeout,
                                                           Delegate& delegate) {
  int epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd < 0) {
    const int err = errno;
    close(listen_fd);
    return ErrnoError("cannot create the control port's epoll set", err);
  }
  // Set once on the listener, which every accepted connection inherits (Linux copies a listening
  // socket's options to the connections it accepts): no frame waits for Nagle, and a host that
  // vanishes without closing its connections is noticed in about 10 s. Five system calls fewer
  // per connection, which the rendezvous of 16k ranks pays 16k times.
  int one = 1;
  setsockopt(listen_fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  wire::EnableKeepAlive(listen_fd);
  return std::unique_ptr<ControlPort>(new TcpControlPort(listen_fd, epoll_fd, std::move(secret),
                                                         clock, handshake_timeout, delegate));
}

TcpControlPort::TcpControlPort(int listen_fd, int epoll_fd, std::string secret, const Clock& clock,
                               Duration handshake_timeout, Delegate& delegate)
    : listen_fd_(listen_fd),
      epoll_fd_(epoll_fd),
      secret_(std::move(secret)),
      clock_(clock),
      handshake_timeout_(handshake_timeout),
      delegate_(delegate) {}

TcpControlPort::~TcpControlPort() {
  by_rank_.assign(by_rank_.size(), nullptr);  // closed without telling the delegate
  for (auto& c : conns_) CloseConn(*c);
  close(epoll_fd_);
  close(listen_fd_);
}

void TcpControlPort::BeginAttempt(int attempt, size_t world_size) {
  by_rank_.assign(by_rank_.size(), nullptr);  // closed without telling the delegate
  for (auto& c : conns_) CloseConn(*c);
  conns_.clear();
  handshaking_.clear();
  unproven_.clear();
  any_closed_ = false;
  hello_nonces_.clear();
  attempt_ = attempt;
  by_rank_.assign(world_size, nullptr);
  answered_.assign(world_size, nullptr);
  dropped_ = 0;
}

void TcpControlPort::Accept() {
  const size_t cap = MaxUnproven(by_rank_.size());
  for (size_t accepted = 0; accepted < std::max<size_t>(cap / 2, 1); ++accepted) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    int fd =
        accept4(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    while (unproven_count_ >= cap) DropOldestUnproven();
    auto conn = std::make_unique<Conn>();
    conn->fd = fd;
    conn->peer = PeerName(addr);
    conn->deadline = clock_.Now() + handshake_timeout_;
    Conn* c = conn.get();
    epoll_event ev{.events = EPOLLIN, .data = {.ptr = c}};
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      close(fd);  // out of memory for the set: as if the peer had not connected
      continue;
    }
    conns_.push_back(std::move(conn));
    handshaking_.push_back(c);
    unproven_.push_back(c);
    ++unproven_count_;
    ReadConn(*c);
  }
}

void TcpControlPort::DropOldestUnproven() {
  while (unproven_.front()->closed || unproven_.front()->stage != Conn::Stage::kHello) {
    unproven_.pop_front();
  }
  if (dropped_++ == 0) {
    delegate_.Say("more than " + std::to_string(MaxUnproven(by_rank_.size())) +
                  " connections to the control port have not sent a valid hello; dropping the "
                  "oldest (is another process flooding the port?)");
  }
  CloseConn(*unproven_.front());
  unproven_.pop_front();
}

// Closes a connection that has not authenticated. `tell`: the peer proved it holds the secret, or
// at least sent a well-framed hello, so it gets the reason in a kRefused frame (one non-blocking
// send; a worker then stops trying instead of reconnecting).
void TcpControlPort::Refuse(Conn& c, const std::string& why, bool tell) {
  if (refusals_++ < kMaxRefusalsSaid) {
    delegate_.Say("refused a control connection from " + c.peer + ": " + why);
  }
  if (tell) {
    // The reason is short: never over the frame limit.
    c.out.Push(*wire::EncodeFrame(wire::MessageType::kRefused, why.substr(0, kMaxRefusalText)));
    Flush(c);
  }
  CloseConn(c);
}

void TcpControlPort::CloseConn(Conn& c, bool timed_out) {
  if (c.closed) return;
  c.closed = true;
  any_closed_ = true;
  if (c.stage == Conn::Stage::kHello) --unproven_count_;
  if (c.stage == Conn::Stage::kAuth && answered_[c.hello.rank] == &c) {
    answered_[c.hello.rank] = nullptr;
  }
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c.fd, nullptr);
  close(c.fd);
  if (c.rank >= 0 && by_rank_[static_cast<size_t>(c.rank)] == &c) {
    by_rank_[static_cast<size_t>(c.rank)] = nullptr;
    delegate_.OnClosed(c.rank, timed_out);
  }
}

// Writes what the socket takes now; the rest waits for EPOLLOUT.
void TcpControlPort::Flush(Conn& c) {
  if (c.closed) return;
  if (!c.out.Flush(c.fd).ok()) {
    // A rank that has gone may have sent its last frames (kDone) just before: they are read
    // before its connection closes, so a notice it never read does not turn into a failure.
    if (c.stage == Conn::Stage::kAuthed) ReadConn(c);
    return CloseConn(c, TimedOut(c.out.send_errno()));
  }
  if (c.watching_out == c.out.empty()) {
    c.watching_out = !c.out.empty();
    epoll_event ev{.events = EPOLLIN | (c.watching_out ? EPOLLOUT : 0u), .data = {.ptr = &c}};
    epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c.fd, &ev);
  }
}

void TcpControlPort::OnConnsReady() {
  epoll_event events[kMaxReadyConns];
  int n = epoll_wait(epoll_fd_, events, kMaxReadyConns, 0);
  for (int i = 0; i < n; ++i) {
    Conn* conn = static_cast<Conn*>(events[i].data.ptr);
    if (conn->closed) continue;  // closed by an earlier event of this call
    if (events[i].events & EPOLLOUT) Flush(*conn);
    if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) ReadConn(*conn);
  }
}

void TcpControlPort::ReadConn(Conn& c) {
  char buf[kReadChunk];
  while (!c.closed) {
    ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      CloseConn(c, n < 0 && TimedOut(errno));
      return;
    }
    Status s = c.decoder.Feed(std::string_view(buf, static_cast<size_t>(n)));
    if (!s.ok()) return DecoderError(c, s);
    while (!c.closed) {
      auto f = c.decoder.NextView();
      if (!f.ok()) return DecoderError(c, f.status());
      if (!f->has_value()) break;
      OnFrame(c, **f);
    }
    // A short read took all there was: what arrives later makes the connection ready again (the
    // epoll set is level-triggered), so no recv() is spent on learning that nothing is left.
    if (static_cast<size_t>(n) < sizeof(buf)) return;
  }
}

void TcpControlPort::DecoderError(Conn& c, const Status& s) {
  if (c.stage == Conn::Stage::kAuthed) {
    delegate_.OnBadFrame(c.rank, s.message());
  } else {
    Refuse(c, s.message());
  }
}

void TcpControlPort::OnFrame(Conn& c, const wire::FrameView& f) {
  switch (c.stage) {
    case Conn::Stage::kHello: return OnHello(c, f);
    case Conn::Stage::kAuth: return OnAuth(c, f);
    case Conn::Stage::kAuthed: {
      // Opened in place, in the decoder's buffer: `f` is the last frame it returned.
      auto opened = c.frames.Open(f.type, c.decoder.last_body(), f.body.size());
      if (!opened.ok()) {
        // Nothing more is read from a stream that someone else has written into.
        const int rank = c.rank;
        delegate_.OnBadFrame(rank, opened.status().message());
        return CloseConn(c);
      }
      if (*opened) delegate_.OnFrame(c.rank, **opened);
      return;
    }
  }
}

void TcpControlPort::OnHello(Conn& c, const wire::FrameView& f) {
  if (f.type != wire::MessageType::kHello) return Refuse(c, "did not start with a hello");
  auto hello = wire::DecodeHello(f.body, secret_);
  if (!hello.ok()) return Refuse(c, hello.status().message(), /*tell=*/true);
  // From here on the hello was made with the secret: a worker of this run, or a replay.
  if (hello->rank >= by_rank_.size() || static_cast<int>(hello->attempt) != attempt_) {
    return Refuse(c,
                  "rank " + std::to_string(hello->rank) + " of attempt " +
                      std::to_string(hello->attempt) + " is not part of this attempt (" +
                      std::to_string(attempt_) + ")",
                  /*tell=*/true);
  }
  if (by_rank_[hello->rank] != nullptr) {
    return Refuse(c, "rank " + std::to_string(hello->rank) + " is already connected",
                  /*tell=*/true);
  }
  if (!hello_nonces_.insert(hello->nonce).second) {
    return Refuse(c, "a replayed hello (its nonce was seen before)");
  }
  if (answered_[hello->rank] != nullptr) {
    // The rank is authenticating on another connection; this one may be its worker's retry after
    // a drop, so it is closed without a reason: the worker tries again, and is told "already
    // connected" once the other connection has authenticated.
    return Refuse(c, "rank " + std::to_string(hello->rank) + " is in a handshake already");
  }
  answered_[hello->rank] = &c;
  c.hello = *hello;
  c.nonce = wire::GenerateNonce();
  wire::Mac proof = wire::ControllerProof(secret_, c.hello, c.nonce);
  std::string body(reinterpret_cast<const char*>(c.nonce.data()), c.nonce.size());
  body.append(reinterpret_cast<const char*>(proof.data()), proof.size());
  c.stage = Conn::Stage::kAuth;
  --unproven_count_;
  c.decoder.set_max_body(wire::kAuthSize);
  c.frames =
      wire::SealedFrames(wire::ControlSession(secret_, f.body, body, wire::SessionEnd::kResponder));
  c.out.Push(*wire::EncodeFrame(wire::MessageType::kChallenge, body));
  Flush(c);
}

void TcpControlPort::OnAuth(Conn& c, const wire::FrameView& f) {
  if (f.type != wire::MessageType::kAuth ||
      !wire::MacEquals(wire::WorkerProof(secret_, c.hello, c.nonce), f.body)) {
    return Refuse(c, "failed authentication (it does not hold this run's secret)");
  }
  // The hello was answered only because the rank had no connection and no other answered hello:
  // this connection is now the rank's.
  answered_[c.hello.rank] = nullptr;
  c.stage = Conn::Stage::kAuthed;
  c.rank = static_cast<int>(c.hello.rank);
  c.decoder.set_max_body(wire::kMaxWorkerFrameBody + wire::kSealedFrameOverhead);
  by_rank_[c.hello.rank] = &c;
}

const TcpControlPort::Conn* TcpControlPort::OldestHandshaking() {
  while (!handshaking_.empty() &&
         (handshaking_.front()->closed || handshaking_.front()->stage == Conn::Stage::kAuthed)) {
    handshaking_.pop_front();
  }
  return handshaking_.empty() ? nullptr : handshaking_.front();
}

std::optional<TimePoint> TcpControlPort::NextDeadline() {
  const Conn* c = OldestHandshaking();
  return c ? std::optional<TimePoint>(c->deadline) : std::nullopt;
}

void TcpControlPort::ExpireHandshakes() {
  const TimePoint now = clock_.Now();
  while (const Conn* c = OldestHandshaking()) {
    if (now < c->deadline) break;
    Conn& conn = *handshaking_.front();
    handshaking_.pop_front();
    if (conn.stage == Conn::Stage::kHello) ++dropped_;
    Refuse(conn, "did not complete the handshake within " +
                     FormatNumber(std::chrono::duration<double>(handshake_timeout_).count()) +
                     " s");
  }
}

void TcpControlPort::Sweep() {
  if (!any_closed_) return;
  any_closed_ = false;
  std::erase_if(handshaking_, [](const Conn* c) { return c->closed; });
  std::erase_if(unproven_, [](const Conn* c) { return c->closed; });
  std::erase_if(conns_, [](const auto& c) { return c->closed; });
}

void TcpControlPort::Send(int rank, wire::MessageType type, std::string_view body) {
  Conn* c = by_rank_[static_cast<size_t>(rank)];
  if (c == nullptr) return;
  std::string frame;
  // The controller's own messages are within the frame limit; the frame numbers of a connection
  // cannot run out (2^64).
  (void)c->frames.Seal(type, body, &frame);
  c->out.Push(std::move(frame));
  Flush(*c);
}

void TcpControlPort::SendShared(int rank, const wire::SharedFrame& shared) {
  Conn* c = by_rank_[static_cast<size_t>(rank)];
  if (c == nullptr) return;
  std::string key;
  (void)c->frames.SealKeyOf(shared, &key);
  c->out.Push(std::move(key));
  c->out.PushShared(shared.frame);
  Flush(*c);
}

void TcpControlPort::Read(int rank) {
  if (Conn* c = by_rank_[static_cast<size_t>(rank)]) ReadConn(*c);
}

void TcpControlPort::Close(int rank) {
  if (Conn* c = by_rank_[static_cast<size_t>(rank)]) CloseConn(*c);
}

}  // namespace jaxtrain::controller
