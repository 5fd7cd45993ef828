#include "controller/controller.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>

#include "controller/report_collector.h"
#include "launch/process.h"
#include "storage/files.h"
#include "storage/run_store.h"
#include "wire/frame.h"
#include "wire/handshake.h"
#include "wire/socket.h"

namespace jaxtrain::controller {
namespace {

constexpr size_t kMaxAuthedBody = 16 << 20;  // reports and tracebacks; far above real use
constexpr size_t kReadChunk = 64 << 10;
constexpr size_t kLogTailBytes = 4096;
constexpr int kMaxRefusalsLogged = 10;
constexpr Duration kDrainTime = std::chrono::seconds(1);

void WriteFully(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    data.remove_prefix(static_cast<size_t>(n));
  }
}

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

}  // namespace

std::string_view OutcomeStateName(Outcome::State state) {
  switch (state) {
    case Outcome::State::kSucceeded: return "FINISHED";
    case Outcome::State::kFailed: return "ERRORED";
    case Outcome::State::kAborted: return "ABORTED";
  }
  return "ABORTED";
}

// All state of a running attempt; touched only by the event-loop thread.
struct Controller::Loop {
  enum class Phase { kStarting, kRunning, kStopping, kDraining };

  struct Conn {
    int fd = -1;
    std::string peer;
    wire::FrameDecoder decoder{wire::kHelloSize};
    std::string out;
    enum class Stage { kHello, kAuth, kAuthed } stage = Stage::kHello;
    wire::Hello hello;
    wire::Nonce nonce{};
    TimePoint deadline;
    int rank = -1;
    bool closed = false;
  };

  struct Proc {
    launch::LaunchedProcess launched;
    int rank = -1;
    int log_fd = -1;
    bool reaped = false;
    launch::ExitStatus exit;
    std::string partial_line;
  };

  struct RankState {
    Conn* conn = nullptr;
    bool registered = false;
    bool done = false;
    std::string host;
    std::string coordinator;
  };

  Loop(Controller& c, storage::RunStore s)
      : ctl(c), opts(c.options_), store(std::move(s)), collector(WorldSize(c), 1) {}

  static int WorldSize(const Controller& c) {
    return static_cast<int>(c.options_.plan.workers.size());
  }

  Controller& ctl;
  const ControllerOptions& opts;
  storage::RunStore store;
  ReportCollector collector;
  std::string secret;
  int listen_fd = -1;
  int attempt = 0;
  double start_time = 0;
  Phase phase = Phase::kStarting;
  std::vector<Proc> procs;
  std::vector<RankState> ranks;
  std::vector<std::unique_ptr<Conn>> conns;
  TimePoint start_deadline;
  std::optional<TimePoint> kill_deadline;
  std::optional<TimePoint> drain_deadline;
  std::optional<RankFailure> failure;
  bool aborted = false;
  std::string abort_reason;
  uint64_t rounds = 0;
  std::string last_metrics;
  int refusals = 0;

  TimePoint Now() const { return ctl.clock_.Now(); }

  void Say(const std::string& line) {
    std::string text = "jaxtrain: " + line + "\n";
    WriteFully(2, text);
  }

  // --- failures and stopping -------------------------------------------------------------------

  void Fail(RankFailure f) {
    if (!failure) {
      f.attempt = attempt;
      if (f.rank >= 0) {
        f.host = ranks[static_cast<size_t>(f.rank)].host;
        f.log_path = store.LogPath(f.rank);
      }
      Say("rank " + std::to_string(f.rank) + " failed: " + f.message);
      failure = std::move(f);
    }
    BeginStop();
  }

  void BeginStop() {
    if (phase == Phase::kStopping || phase == Phase::kDraining) return;
    phase = Phase::kStopping;
    if (listen_fd >= 0) {
      close(listen_fd);
      listen_fd = -1;
    }
    if (AnyUnreaped()) {
      ctl.launcher_->SignalGroup(SIGTERM);
      kill_deadline = Now() + opts.terminate_grace;
    }
  }

  bool AnyUnreaped() const {
    return std::any_of(procs.begin(), procs.end(), [](const Proc& p) { return !p.reaped; });
  }

  // --- connections ---------------------------------------------------------------------------

  void Accept() {
    for (;;) {
      sockaddr_storage addr{};
      socklen_t len = sizeof(addr);
      int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      size_t unauthenticated =
          static_cast<size_t>(std::count_if(conns.begin(), conns.end(), [](const auto& c) {
            return c->stage != Conn::Stage::kAuthed;
          }));
      if (unauthenticated >= ranks.size() * 2 + 64) {
        close(fd);  // a flood of peers that have not proven anything
        continue;
      }
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      auto conn = std::make_unique<Conn>();
      conn->fd = fd;
      conn->peer = PeerName(addr);
      conn->deadline = Now() + opts.handshake_timeout;
      conns.push_back(std::move(conn));
    }
  }

  void Refuse(Conn& c, const std::string& why) {
    if (refusals++ < kMaxRefusalsLogged) {
      Say("refused a control connection from " + c.peer + ": " + why);
    }
    CloseConn(c);
  }

  void CloseConn(Conn& c) {
    if (c.closed) return;
    c.closed = true;
    close(c.fd);
    if (c.rank >= 0 && ranks[static_cast<size_t>(c.rank)].conn == &c) {
      RankState& r = ranks[static_cast<size_t>(c.rank)];
      r.conn = nullptr;
      if (!r.done && phase != Phase::kStopping && phase != Phase::kDraining) {
        Fail({.rank = c.rank,
              .cause = "connection",
              .message = "its control connection closed before its training function returned"});
      }
    }
  }

  void Send(Conn& c, wire::MessageType type, std::string_view body) {
    c.out += wire::EncodeFrame(type, body);
    Flush(c);
  }

  void Flush(Conn& c) {
    while (!c.out.empty() && !c.closed) {
      ssize_t n = send(c.fd, c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n < 0) {
        CloseConn(c);
        return;
      }
      c.out.erase(0, static_cast<size_t>(n));
    }
  }

  void ReadConn(Conn& c) {
    char buf[kReadChunk];
    while (!c.closed) {
      ssize_t n = recv(c.fd, buf, sizeof(buf), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) {
        CloseConn(c);
        return;
      }
      Status s = c.decoder.Feed(std::string_view(buf, static_cast<size_t>(n)));
      if (!s.ok()) return DecoderError(c, s);
      while (!c.closed) {
        auto f = c.decoder.Next();
        if (!f.ok()) return DecoderError(c, f.status());
        if (!f->has_value()) break;
        OnFrame(c, **f);
      }
    }
  }

  void DecoderError(Conn& c, const Status& s) {
    if (c.stage == Conn::Stage::kAuthed) {
      ProtocolError(c, s.message());
    } else {
      Refuse(c, s.message());
    }
  }

  void OnFrame(Conn& c, const wire::Frame& f) {
    using wire::MessageType;
    switch (c.stage) {
      case Conn::Stage::kHello: {
        if (f.type != MessageType::kHello) return Refuse(c, "did not start with a hello");
        auto hello = wire::DecodeHello(f.body);
        if (!hello.ok()) return Refuse(c, hello.status().message());
        if (hello->rank >= ranks.size() || static_cast<int>(hello->attempt) != attempt) {
          return Refuse(c, "rank " + std::to_string(hello->rank) + " of attempt " +
                               std::to_string(hello->attempt) + " is not part of this attempt");
        }
        c.hello = *hello;
        c.nonce = wire::GenerateNonce();
        wire::Mac proof = wire::ControllerProof(secret, c.hello, c.nonce);
        std::string body(reinterpret_cast<const char*>(c.nonce.data()), c.nonce.size());
        body.append(reinterpret_cast<const char*>(proof.data()), proof.size());
        c.stage = Conn::Stage::kAuth;
        c.decoder.set_max_body(wire::kAuthSize);
        Send(c, MessageType::kChallenge, body);
        return;
      }
      case Conn::Stage::kAuth: {
        if (f.type != MessageType::kAuth ||
            !wire::MacEquals(wire::WorkerProof(secret, c.hello, c.nonce), f.body)) {
          return Refuse(c, "failed authentication (it does not hold this run's secret)");
        }
        RankState& r = ranks[c.hello.rank];
        if (r.conn != nullptr) {
          return Refuse(c, "rank " + std::to_string(c.hello.rank) + " is already connected");
        }
        c.stage = Conn::Stage::kAuthed;
        c.rank = static_cast<int>(c.hello.rank);
        c.decoder.set_max_body(kMaxAuthedBody);
        r.conn = &c;
        return;
      }
      case Conn::Stage::kAuthed: return OnWorkerMessage(c, f);
    }
  }

  void OnWorkerMessage(Conn& c, const wire::Frame& f) {
    using wire::MessageType;
    RankState& r = ranks[static_cast<size_t>(c.rank)];
    switch (f.type) {
      case MessageType::kRegister: {
        auto j = nlohmann::json::parse(f.body, nullptr, false);
        if (!j.is_object()) return ProtocolError(c, "registration is not a JSON object");
        r.registered = true;
        r.host = j.value("host", "");
        r.coordinator = j.value("coordinator", "");
        MaybeStartTraining();
        return;
      }
      case MessageType::kReport: {
        uint64_t round = 0;
        std::string_view metrics;
        Status s = wire::DecodeReportBody(f.body, &round, &metrics);
        if (!s.ok()) return ProtocolError(c, s.message());
        for (Round& done : collector.Add(c.rank, std::string(metrics))) Record(done);
        return;
      }
      case MessageType::kError: {
        auto j = nlohmann::json::parse(f.body, nullptr, false);
        RankFailure failure{.rank = c.rank, .cause = "exception"};
        if (j.is_object()) {
          failure.message = j.value("message", "the training function raised an exception");
          failure.traceback = j.value("traceback", "");
          if (j.value("phase", "") == "start-up") failure.cause = "start-up";
        }
        Fail(std::move(failure));
        return;
      }
      case MessageType::kDone: r.done = true; return;
      default:
        return ProtocolError(c,
                             "unexpected message type " + std::to_string(static_cast<int>(f.type)));
    }
  }

  void ProtocolError(Conn& c, const std::string& what) {
    Fail({.rank = c.rank, .cause = "connection", .message = "protocol error: " + what});
    CloseConn(c);
  }

  void MaybeStartTraining() {
    if (phase != Phase::kStarting) return;
    for (const RankState& r : ranks) {
      if (!r.registered) return;
    }
    if (ranks[0].coordinator.empty()) {
      Fail({.rank = 0, .cause = "start-up", .message = "rank 0 did not publish a coordinator"});
      return;
    }
    phase = Phase::kRunning;
    nlohmann::json start = {{"coordinator", ranks[0].coordinator},
                            {"world_size", ranks.size()},
                            {"attempt", attempt},
                            {"run_dir", store.dir()},
                            {"experiment_name", opts.experiment_name}};
    std::string start_body = start.dump();
    for (RankState& r : ranks) {
      Send(*r.conn, wire::MessageType::kStart, start_body);
      if (r.conn) Send(*r.conn, wire::MessageType::kPayload, opts.payload);
    }
  }

  void Record(const Round& round) {
    Status s = store.AppendRound(round.round, ctl.clock_.UnixSeconds(), round.metrics_json);
    if (!s.ok()) {
      Say("cannot record report round " + std::to_string(round.round) + ": " + s.message());
      return;
    }
    rounds = round.round;
    last_metrics = round.metrics_json;
  }

  // --- processes -----------------------------------------------------------------------------

  void OnProcessExit(Proc& p) {
    auto status = launch::TryReap(p.launched.pid);
    if (!status) return;
    p.reaped = true;
    p.exit = *status;
    close(p.launched.pidfd);
    p.launched.pidfd = -1;
    RankState& r = ranks[static_cast<size_t>(p.rank)];
    // A frame sent just before exit may still be unread: read it first.
    if (r.conn) ReadConn(*r.conn);
    const bool stopping = phase == Phase::kStopping || phase == Phase::kDraining;
    RankFailure exit_failure{
        .rank = p.rank,
        .cause = p.exit.signal ? "signal" : "exit",
        .message = "its process " + p.exit.ToString() +
                   (p.exit.ok() ? " before its training function returned" : "")};
    // The connection usually closes just before the exit is seen; the exit says more.
    if (failure && failure->rank == p.rank && failure->cause == "connection") {
      failure->cause = exit_failure.cause;
      failure->message = exit_failure.message;
    }
    if (stopping || (p.exit.ok() && r.done)) return;
    Fail(std::move(exit_failure));
  }

  void ReadOutput(Proc& p) {
    char buf[kReadChunk];
    for (;;) {
      ssize_t n = read(p.launched.output_fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) {
        CloseOutput(p);
        return;
      }
      std::string_view chunk(buf, static_cast<size_t>(n));
      WriteFully(p.log_fd, chunk);
      EchoLines(p, chunk);
    }
  }

  void EchoLines(Proc& p, std::string_view chunk) {
    if (opts.console_fd < 0) return;
    p.partial_line.append(chunk);
    size_t start = 0;
    std::string text;
    const std::string prefix = "(rank=" + std::to_string(p.rank) + ") ";
    for (size_t nl; (nl = p.partial_line.find('\n', start)) != std::string::npos; start = nl + 1) {
      text += prefix;
      text.append(p.partial_line, start, nl + 1 - start);
    }
    p.partial_line.erase(0, start);
    WriteFully(opts.console_fd, text);
  }

  void CloseOutput(Proc& p) {
    if (p.launched.output_fd < 0) return;
    if (!p.partial_line.empty()) EchoLines(p, "\n");
    close(p.launched.output_fd);
    p.launched.output_fd = -1;
  }

  // --- the loop ------------------------------------------------------------------------------

  void CheckTimers() {
    TimePoint now = Now();
    for (auto& c : conns) {
      if (!c->closed && c->stage != Conn::Stage::kAuthed && now >= c->deadline) {
        Refuse(*c, "did not complete the handshake in time");
      }
    }
    if (phase == Phase::kStarting && now >= start_deadline) {
      int missing = 0;
      while (missing < static_cast<int>(ranks.size()) && ranks[missing].registered) ++missing;
      Fail({.rank = missing,
            .cause = "start-up",
            .message = "it did not connect to the controller within the start-up timeout"});
    }
    if (kill_deadline && now >= *kill_deadline) {
      kill_deadline.reset();
      if (AnyUnreaped()) {
        Say("workers did not stop within the grace period; sending SIGKILL");
        ctl.launcher_->SignalGroup(SIGKILL);
      }
    }
  }

  std::optional<TimePoint> NextDeadline() const {
    std::optional<TimePoint> next;
    auto consider = [&](TimePoint t) { next = next ? std::min(*next, t) : t; };
    for (const auto& c : conns) {
      if (!c->closed && c->stage != Conn::Stage::kAuthed) consider(c->deadline);
    }
    if (phase == Phase::kStarting) consider(start_deadline);
    if (kill_deadline) consider(*kill_deadline);
    if (drain_deadline) consider(*drain_deadline);
    return next;
  }

  bool OutputsOpen() const {
    return std::any_of(procs.begin(), procs.end(),
                       [](const Proc& p) { return p.launched.output_fd >= 0; });
  }

  // True once the attempt is over: every process reaped and its output drained.
  bool Step() {
    if (ctl.abort_requested_.exchange(false)) {
      std::lock_guard<std::mutex> lock(ctl.mu_);
      if (!aborted && !failure && phase != Phase::kDraining) {
        aborted = true;
        abort_reason = ctl.abort_reason_;
        Say("stopping the run: " + abort_reason);
      }
      BeginStop();
    }
    if (!AnyUnreaped()) {
      if (!drain_deadline) drain_deadline = Now() + kDrainTime;
      phase = Phase::kDraining;
      if (!OutputsOpen() || Now() >= *drain_deadline) return true;
    }

    std::vector<pollfd> fds;
    std::vector<std::function<void(short)>> handlers;
    fds.push_back({ctl.wake_fd_, POLLIN, 0});
    handlers.push_back([this](short) {
      uint64_t v;
      [[maybe_unused]] ssize_t n = read(ctl.wake_fd_, &v, sizeof(v));
    });
    if (listen_fd >= 0) {
      fds.push_back({listen_fd, POLLIN, 0});
      handlers.push_back([this](short) { Accept(); });
    }
    for (auto& c : conns) {
      if (c->closed) continue;
      Conn* conn = c.get();
      fds.push_back({conn->fd, static_cast<short>(POLLIN | (conn->out.empty() ? 0 : POLLOUT)), 0});
      handlers.push_back([this, conn](short ev) {
        if (ev & POLLOUT) Flush(*conn);
        if (ev & (POLLIN | POLLHUP | POLLERR)) ReadConn(*conn);
      });
    }
    // Connections before processes: a worker's last frames are handled before its exit.
    for (auto& p : procs) {
      Proc* proc = &p;
      if (p.launched.output_fd >= 0) {
        fds.push_back({p.launched.output_fd, POLLIN, 0});
        handlers.push_back([this, proc](short) { ReadOutput(*proc); });
      }
    }
    for (auto& p : procs) {
      Proc* proc = &p;
      if (!p.reaped) {
        fds.push_back({p.launched.pidfd, POLLIN, 0});
        handlers.push_back([this, proc](short) { OnProcessExit(*proc); });
      }
    }

    int timeout_ms = -1;
    if (auto next = NextDeadline()) {
      auto ms = std::chrono::ceil<std::chrono::milliseconds>(*next - Now()).count();
      timeout_ms = static_cast<int>(std::clamp<long long>(ms, 0, 60'000));
    }
    int n = poll(fds.data(), fds.size(), timeout_ms);
    if (n > 0) {
      for (size_t i = 0; i < fds.size(); ++i) {
        if (fds[i].revents != 0) handlers[i](fds[i].revents);
      }
    }
    CheckTimers();
    conns.erase(std::remove_if(conns.begin(), conns.end(), [](const auto& c) { return c->closed; }),
                conns.end());
    return false;
  }

  Outcome Finish() {
    for (auto& p : procs) CloseOutput(p);
    for (auto& p : procs) {
      if (p.log_fd >= 0) close(p.log_fd);
    }
    for (auto& c : conns) CloseConn(*c);
    conns.clear();
    if (listen_fd >= 0) close(listen_fd);

    Outcome out;
    for (Round& r : collector.TakeUnmatchedRank0()) Record(r);
    std::string mismatch = collector.CountMismatchWarning();
    if (!mismatch.empty()) {
      Say("warning: " + mismatch);
      out.warnings.push_back(mismatch);
    }
    if (failure) {
      out.state = Outcome::State::kFailed;
      failure->log_tail = storage::TailOfFile(failure->log_path, kLogTailBytes);
      std::string text = "rank " + std::to_string(failure->rank) + " (host " + failure->host +
                         ", attempt " + std::to_string(failure->attempt) +
                         "): " + failure->message + "\n";
      if (!failure->traceback.empty()) text += "\n" + failure->traceback;
      text += "\n--- last lines of " + failure->log_path + " ---\n" + failure->log_tail;
      Status s = store.WriteError(text);
      if (!s.ok()) Say("cannot write error.txt: " + s.message());
      out.failure = failure;
    } else if (aborted) {
      out.state = Outcome::State::kAborted;
      out.abort_reason = abort_reason;
    } else {
      out.state = Outcome::State::kSucceeded;
    }
    out.rounds = rounds;
    out.last_metrics_json = last_metrics;
    WriteRunState(OutcomeStateName(out.state));
    return out;
  }

  void WriteRunState(std::string_view status) {
    nlohmann::json attempt_state = {
        {"attempt", attempt}, {"start_time", start_time}, {"status", status}};
    if (status != "RUNNING") attempt_state["end_time"] = ctl.clock_.UnixSeconds();
    if (failure) {
      attempt_state["failure"] = {{"rank", failure->rank},
                                  {"host", failure->host},
                                  {"cause", failure->cause},
                                  {"message", failure->message}};
    }
    nlohmann::json state = {{"name", opts.experiment_name},
                            {"status", status},
                            {"world_size", ranks.size()},
                            {"platform", opts.plan.platform},
                            {"simulated", opts.plan.simulated},
                            {"start_time", start_time},
                            {"rounds", rounds},
                            {"attempts", nlohmann::json::array({attempt_state})},
                            {"config", opts.run_config}};
    if (status != "RUNNING") state["end_time"] = ctl.clock_.UnixSeconds();
    Status s = store.WriteRunState(state);
    if (!s.ok()) Say("cannot write run.json: " + s.message());
  }
};

Controller::Controller(ControllerOptions options, std::unique_ptr<launch::Launcher> launcher,
                       const Clock& clock)
    : options_(std::move(options)), launcher_(std::move(launcher)), clock_(clock) {}

Controller::~Controller() {
  if (thread_.joinable()) {
    Abort("the controller was destroyed while the run was in progress");
    thread_.join();
  }
  if (wake_fd_ >= 0) close(wake_fd_);
}

Status Controller::Start() {
  const int world_size = static_cast<int>(options_.plan.workers.size());
  if (world_size == 0) return InvalidArgumentError("the plan has no workers");
  JT_ASSIGN_OR_RETURN(storage::RunStore store, storage::RunStore::Open(options_.run_dir));
  auto loop = std::make_unique<Loop>(*this, std::move(store));
  JT_ASSIGN_OR_RETURN(loop->listen_fd, wire::Listen(options_.listen_host, 0, &port_));
  loop->secret = wire::GenerateSecret();
  loop->ranks.resize(static_cast<size_t>(world_size));
  loop->start_time = clock_.UnixSeconds();

  const std::string address = wire::HostPort{options_.listen_host, port_}.ToString();
  std::vector<launch::ProcessSpec> specs;
  for (const auto& w : options_.plan.workers) {
    launch::ProcessSpec spec;
    spec.ranks = {w.rank};
    spec.argv = options_.worker_argv;
    spec.cwd = options_.worker_cwd;
    spec.env = w.env;
    for (const auto& [k, v] : options_.worker_env) spec.env[k] = v;
    spec.env["JAXTRAIN_CONTROLLER_ADDR"] = address;
    spec.env["JAXTRAIN_RUN_SECRET"] = wire::ToHex(loop->secret);
    spec.env["JAXTRAIN_RANK"] = std::to_string(w.rank);
    spec.env["JAXTRAIN_WORLD_SIZE"] = std::to_string(world_size);
    spec.env["JAXTRAIN_LOCAL_RANK"] = std::to_string(w.local_rank);
    spec.env["JAXTRAIN_LOCAL_WORLD_SIZE"] = std::to_string(w.local_world_size);
    spec.env["JAXTRAIN_NODE_RANK"] = std::to_string(w.node_rank);
    spec.env["JAXTRAIN_ATTEMPT"] = std::to_string(loop->attempt);
    spec.env["JAXTRAIN_RUN_DIR"] = loop->store.dir();
    spec.env["JAXTRAIN_EXPERIMENT_NAME"] = options_.experiment_name;
    spec.env["JAXTRAIN_PLATFORM"] = options_.plan.platform;
    specs.push_back(std::move(spec));
  }
  for (int r = 0; r < world_size; ++r) {
    std::string path = loop->store.LogPath(r);
    int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
      for (auto& p : loop->procs) close(p.log_fd);
      close(loop->listen_fd);
      return PermissionDeniedError("cannot open the log file '" + path +
                                   "': " + std::strerror(errno));
    }
    loop->procs.push_back({.rank = r, .log_fd = fd});
  }
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  loop->WriteRunState("RUNNING");
  auto launched = launcher_->Launch(specs);
  if (!launched.ok()) {
    for (auto& p : loop->procs) close(p.log_fd);
    close(loop->listen_fd);
    return launched.status();
  }
  for (size_t i = 0; i < launched->size(); ++i) loop->procs[i].launched = (*launched)[i];
  loop->start_deadline = clock_.Now() + options_.start_timeout;
  loop_ = std::move(loop);
  thread_ = std::thread([this] { RunLoop(); });
  return OkStatus();
}

void Controller::RunLoop() {
  while (!loop_->Step()) {
  }
  Outcome out = loop_->Finish();
  std::lock_guard<std::mutex> lock(mu_);
  outcome_ = std::move(out);
  done_ = true;
  done_cv_.notify_all();
}

bool Controller::Wait(Duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return done_cv_.wait_for(lock, timeout, [this] { return done_; });
}

void Controller::Abort(std::string reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_ || wake_fd_ < 0) return;
    if (abort_reason_.empty()) abort_reason_ = std::move(reason);
  }
  abort_requested_ = true;
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
}

}  // namespace jaxtrain::controller
