#include "worker/worker_client.h"

#include <fcntl.h>
#include <linux/sockios.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

#include "wire/handshake.h"

namespace jaxtrain::worker {
namespace {

// The SIGTERM and SIGUSR1 handler's way out: one byte down this pipe to the notice thread ('T'
// or 'U').
int notice_pipe[2] = {-1, -1};

void OnSigterm(int sig) {
  const int saved = errno;
  const char byte = sig == SIGUSR1 ? 'U' : 'T';
  if (notice_pipe[1] >= 0) [[maybe_unused]]
    ssize_t n = write(notice_pipe[1], &byte, 1);
  errno = saved;
}

constexpr auto kNoticeAnswerTimeout = std::chrono::seconds(5);

// A ping whose body begins so asks the rank to trace steps (TakeProfileRequest()).
constexpr std::string_view kProfilePrefix = "profile ";

}  // namespace

StatusOr<std::string> TakeRunSecret() {
  auto take = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    std::string out = v ? v : "";
    unsetenv(name);
    return out;
  };
  const std::string fd_text = take("JAXTRAIN_RUN_SECRET_FD");
  const std::string path = take("JAXTRAIN_RUN_SECRET_FILE");
  std::string hex = take("JAXTRAIN_RUN_SECRET");
  int fd = -1;
  if (!fd_text.empty()) {
    fd = std::atoi(fd_text.c_str());
  } else if (!path.empty()) {
    fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoError("open " + path, errno);
  }
  if (fd >= 0) {
    hex.clear();
    char buf[256];
    for (ssize_t n; (n = read(fd, buf, sizeof(buf))) != 0;) {
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int err = errno;
        close(fd);
        return ErrnoError("reading the run secret", err);
      }
      hex.append(buf, static_cast<size_t>(n));
    }
    close(fd);
    if (fd == 0) {  // srun's stdin (the Slurm launcher): the rest of the process gets /dev/null
      int null = open("/dev/null", O_RDONLY);  // fd 0 itself, the lowest free one
      if (null > 0) {
        dup2(null, 0);
        close(null);
      }
    }
    if (!path.empty()) unlink(path.c_str());  // best effort: a read-only mount keeps it
  }
  while (!hex.empty() && (hex.back() == '\n' || hex.back() == ' ')) hex.pop_back();
  if (hex.empty()) {
    return InvalidArgumentError(
        "no run secret: JAXTRAIN_RUN_SECRET_FD, JAXTRAIN_RUN_SECRET_FILE or JAXTRAIN_RUN_SECRET "
        "must be set (workers are started by jaxtrain)");
  }
  return wire::FromHex(hex);
}

namespace {

constexpr size_t kMaxRefusalSize = 256;  // a kRefused body: one line of reason
// How long a last frame waits to be acknowledged (SendLast): a controller that reads nothing for
// this long is stuck or gone, and the worker ends anyway.
constexpr std::chrono::seconds kLastFrameTimeout{10};

std::string Millis(Duration d) {
  return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(d).count()) + " ms";
}

}  // namespace

Duration ConnectRetryDelay(int tries) {
  Duration delay = std::chrono::milliseconds(10);
  for (int i = 1; i < tries && delay < std::chrono::milliseconds(500); ++i) delay *= 2;
  return std::min<Duration>(delay, std::chrono::milliseconds(500));
}

StatusOr<std::unique_ptr<WorkerClient>> WorkerClient::Connect(const WorkerClientOptions& o) {
  const TimePoint deadline = std::chrono::steady_clock::now() + o.timeout;
  for (int tries = 1;; ++tries) {
    auto client = TryConnect(o, deadline);
    if (client.ok() || client.status().code() != StatusCode::kAborted) return client;
    Duration delay = ConnectRetryDelay(tries);
    if (std::chrono::steady_clock::now() + delay >= deadline) {
      return DeadlineExceededError(
          "the controller at " + o.controller.ToString() + " refused this worker (rank " +
          std::to_string(o.rank) + ", attempt " + std::to_string(o.attempt) +
          ") or did not answer its hello: it closed " + std::to_string(tries) +
          " connection(s) unanswered within " + Millis(o.timeout) +
          " (is another process flooding its control port?)");
    }
    std::this_thread::sleep_for(delay);
  }
}

StatusOr<std::unique_ptr<WorkerClient>> WorkerClient::TryConnect(const WorkerClientOptions& o,
                                                                 TimePoint deadline) {
  const Duration left = deadline - std::chrono::steady_clock::now();
  JT_ASSIGN_OR_RETURN(int fd, wire::Connect(o.controller, left, o.source_address));
  std::unique_ptr<WorkerClient> client(new WorkerClient(fd));
  // Bound the handshake: a silent peer must not hold the worker forever. A zero timeval would
  // mean no bound at all, so the microseconds count and the bound is at least one.
  const auto usec = std::max<int64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                          deadline - std::chrono::steady_clock::now())
                                          .count(),
                                      1);
  timeval tv{static_cast<time_t>(usec / 1'000'000), static_cast<suseconds_t>(usec % 1'000'000)};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));

  wire::Hello hello{.rank = o.rank,
                    .attempt = o.attempt,
                    .pid = static_cast<uint32_t>(getpid()),
                    .nonce = wire::GenerateNonce()};
  client->decoder_.set_max_body(std::max(wire::kChallengeSize, kMaxRefusalSize));
  const std::string who =
      "rank " + std::to_string(o.rank) + ", attempt " + std::to_string(o.attempt);
  const std::string hello_body = wire::EncodeHello(hello, o.secret);
  Status sent = client->Send(wire::MessageType::kHello, hello_body);
  if (!sent.ok()) return AbortedError("the controller closed the connection: " + sent.message());
  auto challenge = client->ReadFrame();
  if (!challenge.ok() && challenge.status().code() == StatusCode::kDeadlineExceeded) {
    return DeadlineExceededError("the controller at " + o.controller.ToString() +
                                 " did not answer the hello of rank " + std::to_string(o.rank) +
                                 " within " + Millis(o.timeout));
  }
  if (!challenge.ok() && challenge.status().code() == StatusCode::kUnavailable) {
    return AbortedError(challenge.status().message());  // dropped unanswered: try again
  }
  if (challenge.ok() && challenge->type == wire::MessageType::kRefused) {
    return UnauthenticatedError("the controller at " + o.controller.ToString() +
                                " refused this worker (" + who + "): " + challenge->body);
  }
  if (!challenge.ok() || challenge->type != wire::MessageType::kChallenge ||
      challenge->body.size() != wire::kChallengeSize) {
    return UnauthenticatedError("the controller at " + o.controller.ToString() +
                                " refused this worker (" + who + ") or did not answer its hello");
  }
  wire::Nonce controller_nonce;
  std::memcpy(controller_nonce.data(), challenge->body.data(), wire::kNonceSize);
  if (!wire::MacEquals(wire::ControllerProof(o.secret, hello, controller_nonce),
                       std::string_view(challenge->body).substr(wire::kNonceSize))) {
    return UnauthenticatedError("the peer at " + o.controller.ToString() +
                                " could not prove it holds this run's secret; not trusting it");
  }
  wire::Mac proof = wire::WorkerProof(o.secret, hello, controller_nonce);
  JT_ASSIGN_OR_RETURN(
      std::string frames,
      wire::EncodeFrame(
          wire::MessageType::kAuth,
          std::string_view(reinterpret_cast<const char*>(proof.data()), proof.size())));
  // Every frame after the proof, both ways, is sealed with the session of this handshake.
  client->frames_ = wire::SealedFrames(
      wire::ControlSession(o.secret, hello_body, challenge->body, wire::SessionEnd::kInitiator));
  client->sealed_ = true;
  if (!o.registration.empty()) {
    JT_RETURN_IF_ERROR(client->frames_.Seal(wire::MessageType::kRegister, o.registration, &frames));
  }
  JT_RETURN_IF_ERROR(wire::WriteAll(fd, frames));
  timeval none{0, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));
  // A controller whose host vanishes (a network cut between hosts) ends this worker as a closed
  // connection does (WatchController), instead of leaving it behind. The controller reads
  // everything a worker sends at once, so unacknowledged reports mean it is gone.
  wire::EnableKeepAlive(fd, std::chrono::seconds(30));
  client->decoder_.set_max_body(wire::kMaxControllerFrameBody + wire::kSealedFrameOverhead);
  return client;
}

WorkerClient::~WorkerClient() {
  Stop();
  close(fd_);
}

Status WorkerClient::Send(wire::MessageType type, std::string_view body) {
  std::lock_guard<std::mutex> lock(send_mu_);
  if (!sealed_) {  // the hello
    JT_ASSIGN_OR_RETURN(std::string frame, wire::EncodeFrame(type, body));
    return wire::WriteAll(fd_, frame);
  }
  // Sealed under the lock: the frame numbers follow the order of the writes.
  send_buffer_.clear();
  JT_RETURN_IF_ERROR(frames_.Seal(type, body, &send_buffer_));
  return wire::WriteAll(fd_, send_buffer_);
}

StatusOr<wire::Frame> WorkerClient::ReadFrame() {
  char buf[65536];
  for (;;) {
    JT_ASSIGN_OR_RETURN(std::optional<wire::Frame> f, decoder_.Next());
    if (f && sealed_) {
      // Nothing from the controller is used, or unpickled by the worker, before it opens here.
      JT_ASSIGN_OR_RETURN(std::optional<wire::FrameView> opened,
                          frames_.Open(f->type, f->body.data(), f->body.size()));
      if (!opened) continue;  // a shared frame's key: the shared frame follows
      f->body.resize(opened->body.size());
    }
    if (f) return *std::move(f);
    ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      return DeadlineExceededError("the controller did not answer in time");
    }
    if (n <= 0) return UnavailableError("the controller closed the connection");
    JT_RETURN_IF_ERROR(decoder_.Feed(std::string_view(buf, static_cast<size_t>(n))));
  }
}

StatusOr<StartInfo> WorkerClient::WaitStart() {
  StartInfo info;
  JT_ASSIGN_OR_RETURN(wire::Frame start, ReadFrame());
  if (start.type != wire::MessageType::kStart) {
    return UnavailableError("expected the start message, got type " +
                            std::to_string(static_cast<int>(start.type)));
  }
  JT_ASSIGN_OR_RETURN(wire::Frame payload, ReadFrame());
  if (payload.type != wire::MessageType::kPayload) {
    return UnavailableError("expected the payload, got type " +
                            std::to_string(static_cast<int>(payload.type)));
  }
  info.json = std::move(start.body);
  info.payload = std::move(payload.body);
  return info;
}

Status WorkerClient::Report(uint64_t round, std::string_view metrics_json) {
  constexpr size_t kLimit = wire::kMaxWorkerFrameBody - wire::kReportHeaderSize;
  if (metrics_json.size() > kLimit) {
    return InvalidArgumentError("report() metrics are too large (" +
                                std::to_string(metrics_json.size()) + " bytes, limit " +
                                std::to_string(kLimit) + "); report large values as files");
  }
  NoteRound(round);
  return Send(wire::MessageType::kReport, wire::EncodeReportBody(round, metrics_json));
}

Status WorkerClient::ReportCheckpoint(uint64_t round, std::string_view checkpoint_json,
                                      std::string_view metrics_json) {
  constexpr size_t kLimit = wire::kMaxWorkerFrameBody - wire::kCheckpointReportHeaderSize;
  if (checkpoint_json.size() + metrics_json.size() > kLimit) {
    return InvalidArgumentError(
        "report() metrics are too large (" + std::to_string(metrics_json.size()) +
        " bytes, with the checkpoint's file list " + std::to_string(checkpoint_json.size()) +
        " bytes; limit " + std::to_string(kLimit) + " together); report large values as files");
  }
  JT_ASSIGN_OR_RETURN(std::string body,
                      wire::EncodeCheckpointReportBody(round, checkpoint_json, metrics_json));
  {
    // Counted before it is sent: the notice for it may arrive before Send() returns.
    MutexLock lock(settle_mu_);
    ++checkpoints_reported_;
  }
  NoteRound(round);
  return Send(wire::MessageType::kReportCheckpoint, body);
}

Status WorkerClient::WaitCheckpointsSettled() {
  settling_.store(true, std::memory_order_relaxed);
  struct Clear {
    std::atomic<bool>& flag;
    ~Clear() { flag.store(false, std::memory_order_relaxed); }
  } clear{settling_};
  MutexLock lock(settle_mu_);
  settle_cv_.Wait(settle_mu_, [this]() REQUIRES(settle_mu_) {
    return released_ || lost_ || checkpoints_settled_ >= checkpoints_reported_;
  });
  if (released_ || checkpoints_settled_ >= checkpoints_reported_) return OkStatus();
  return UnavailableError("the connection to the controller ended before the checkpoint's commit");
}

StatusOr<std::string> WorkerClient::Collective(const wire::Collective& call) {
  if (call.data.size() > wire::kMaxCollectiveData) {
    return InvalidArgumentError(
        std::string(wire::CollectiveKindName(call.kind)) + "'s data is " +
        std::to_string(call.data.size()) + " bytes pickled, more than the limit of " +
        std::to_string(wire::kMaxCollectiveData) +
        "; broadcast small objects only (write large ones to a file and broadcast its path)");
  }
  JT_ASSIGN_OR_RETURN(std::string body, wire::EncodeWorkerMessage(call));
  collective_kind_.store(static_cast<uint8_t>(call.kind), std::memory_order_relaxed);
  collective_sequence_.store(call.sequence, std::memory_order_relaxed);
  struct Clear {
    std::atomic<uint64_t>& sequence;
    ~Clear() { sequence.store(0, std::memory_order_relaxed); }
  } clear{collective_sequence_};
  JT_RETURN_IF_ERROR(Send(wire::MessageType::kCollective, body));
  MutexLock lock(settle_mu_);
  settle_cv_.Wait(settle_mu_, [this]() REQUIRES(settle_mu_) { return lost_ || release_; });
  if (!release_) {
    return UnavailableError("the connection to the controller ended before every rank made " +
                            std::string(wire::CollectiveKindName(call.kind)));
  }
  StatusOr<wire::Collective> release = *std::move(release_);
  release_.reset();
  JT_RETURN_IF_ERROR(release.status());
  if (release->sequence != call.sequence || release->kind != call.kind) {
    return DataLossError("the controller released collective call " +
                         std::to_string(release->sequence) + " (" +
                         std::string(wire::CollectiveKindName(release->kind)) +
                         ") while this rank waited in call " + std::to_string(call.sequence) +
                         " (" + std::string(wire::CollectiveKindName(call.kind)) + ")");
  }
  return std::string(release->data);
}

Status WorkerClient::SendError(std::string_view json) {
  return SendLast(wire::MessageType::kError, json);
}

Status WorkerClient::SendDone(std::string_view json) {
  return SendLast(wire::MessageType::kDone, json);
}

Status WorkerClient::SendLast(wire::MessageType type, std::string_view body) {
  JT_RETURN_IF_ERROR(Send(type, body));
  // The kernel's send queue (SIOCOUTQ) holds what the peer has not acknowledged; there is no
  // event for it becoming empty, so it is looked at every millisecond.
  const auto deadline = std::chrono::steady_clock::now() + kLastFrameTimeout;
  for (;;) {
    int unacknowledged = 0;
    if (ioctl(fd_, SIOCOUTQ, &unacknowledged) != 0 || unacknowledged == 0) return OkStatus();
    if (std::chrono::steady_clock::now() >= deadline) {
      return DeadlineExceededError("the controller did not take the worker's last " +
                                   std::to_string(unacknowledged) + " bytes within " +
                                   Millis(kLastFrameTimeout));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void WorkerClient::WatchController(int exit_code) {
  if (watcher_.joinable()) return;
  watcher_ = std::thread([this, exit_code] {
    Status ended = OkStatus();
    for (;;) {
      StatusOr<wire::Frame> f = ReadFrame();
      if (!f.ok()) {
        ended = f.status();
        break;
      }
      if (f->type == wire::MessageType::kPreemptionReply) {
        OnPreemptionReply(f->body);
        continue;
      }
      if (f->type == wire::MessageType::kPing && f->body.starts_with(kProfilePrefix)) {
        {
          MutexLock lock(profile_mu_);
          profile_request_ = f->body.substr(kProfilePrefix.size());
        }
        profile_requested_.store(true, std::memory_order_release);
        continue;  // not answered: a pong answers whether the process is alive, or its stacks
      }
      if (f->type == wire::MessageType::kPing) {  // answered here, whatever training is doing
        [[maybe_unused]] Status s =
            Send(wire::MessageType::kPong, f->body == "stacks" ? TakeStacks() : std::string());
        continue;
      }
      if (f->type == wire::MessageType::kCollectiveRelease) {
        MutexLock lock(settle_mu_);
        release_body_ = std::move(f->body);
        release_ = wire::DecodeCollectiveRelease({f->type, release_body_});
        if (!release_->ok()) release_ = DataLossError(release_->status().message());
        settle_cv_.NotifyAll();
        continue;
      }
      if (f->type != wire::MessageType::kCheckpointSettled) continue;
      MutexLock lock(settle_mu_);
      if (f->body == "release") {
        released_ = true;
      } else {
        ++checkpoints_settled_;
      }
      settle_cv_.NotifyAll();
    }
    {
      MutexLock lock(settle_mu_);
      lost_ = true;
      settle_cv_.NotifyAll();
    }
    std::lock_guard<std::mutex> lock(send_mu_);
    if (stopping_ || exit_code < 0) return;
    const std::string message =
        ended.code() == StatusCode::kUnauthenticated
            ? "jaxtrain worker: ending the connection to the controller: " + ended.message() +
                  "; exiting\n"
            : "jaxtrain worker: lost the connection to the controller; exiting\n";
    [[maybe_unused]] ssize_t w = write(2, message.data(), message.size());
    _exit(exit_code);
  });
}

std::string WorkerClient::TakeProfileRequest() {
  if (!profile_requested_.load(std::memory_order_acquire)) return "";
  MutexLock lock(profile_mu_);
  profile_requested_.store(false, std::memory_order_relaxed);
  return std::move(profile_request_);
}

void WorkerClient::EnableStacks(int fd, int signal, uint64_t thread) {
  stacks_fd_ = fd;
  stacks_signal_ = signal;
  stacks_thread_ = thread;
}

std::string WorkerClient::TakeStacks() {
  if (stacks_fd_ < 0) return "";  // a worker that cannot take them answers as before
  wire::Pong pong{.has_stacks = true, .thread = stacks_thread_};
  if (const uint64_t sequence = collective_sequence_.load(std::memory_order_relaxed)) {
    pong.collective = std::string(wire::CollectiveKindName(static_cast<wire::CollectiveKind>(
                          collective_kind_.load(std::memory_order_relaxed)))) +
                      " call " + std::to_string(sequence);
  }
  pong.settling = settling_.load(std::memory_order_relaxed);
  // A signal sent to the calling thread is handled before pthread_kill() returns, so the dump is
  // complete once it has; the handler writes at the descriptor's offset.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, stacks_signal_);
  int err = 0;
  off_t size = -1;
  if (ftruncate(stacks_fd_, 0) != 0 || lseek(stacks_fd_, 0, SEEK_SET) != 0) {
    err = errno;
  } else if ((err = pthread_sigmask(SIG_UNBLOCK, &set, nullptr)) == 0 &&
             (err = pthread_kill(pthread_self(), stacks_signal_)) == 0) {
    size = lseek(stacks_fd_, 0, SEEK_END);
    if (size < 0) err = errno;
  }
  if (err != 0) {
    pong.error = std::string("the stacks could not be taken: ") + std::strerror(err);
  } else if (size == 0) {
    pong.error = "the stacks could not be taken: nothing was dumped on signal " +
                 std::to_string(stacks_signal_) +
                 " (did the training function install a handler of its own for it?)";
  } else {
    // At most half the frame's limit: room for the rest of the answer, escaped.
    pong.stacks.resize(std::min<size_t>(static_cast<size_t>(size), wire::kMaxWorkerFrameBody / 4));
    const ssize_t n = pread(stacks_fd_, pong.stacks.data(), pong.stacks.size(), 0);
    pong.stacks.resize(n > 0 ? static_cast<size_t>(n) : 0);
  }
  StatusOr<std::string> body = wire::EncodeWorkerMessage(pong);
  return body.ok() ? *body : std::string();
}

void WorkerClient::Stop() {
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    stopping_ = true;
  }
  if (notice_thread_.joinable()) {
    signal(SIGTERM, SIG_DFL);
    const int write_end = notice_pipe[1];
    notice_pipe[1] = -1;
    close(write_end);  // the notice thread reads the end of the pipe and returns
    notice_thread_.join();
    close(notice_pipe[0]);
  }
  if (watcher_.joinable()) {
    shutdown(fd_, SHUT_RD);
    watcher_.join();
  }
}

Status WorkerClient::WatchPreemption(int usr1_notice_s) {
  if (notice_thread_.joinable()) return OkStatus();
  if (pipe2(notice_pipe, O_CLOEXEC) != 0) return ErrnoError("pipe2", errno);
  fcntl(notice_pipe[1], F_SETFL, O_NONBLOCK);  // a handler never blocks
  struct sigaction action {};
  action.sa_handler = OnSigterm;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  if (sigaction(SIGTERM, &action, nullptr) != 0) return ErrnoError("sigaction SIGTERM", errno);
  if (usr1_notice_s >= 0 && sigaction(SIGUSR1, &action, nullptr) != 0) {
    return ErrnoError("sigaction SIGUSR1", errno);
  }
  notice_thread_ = std::thread([this, usr1_notice_s] {
    char byte;
    for (;;) {
      ssize_t n = read(notice_pipe[0], &byte, 1);
      if (n < 0 && errno == EINTR) continue;
      if (n != 1) return;  // Stop() closed the pipe
      nlohmann::json notice = {{"source", "SIGTERM"}};
      if (byte == 'U') {  // Slurm's --signal=USR1@<s>: the time limit comes in that many seconds
        notice["source"] = "SIGUSR1 (Slurm time limit)";
        const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
            std::chrono::system_clock::now().time_since_epoch());
        if (usr1_notice_s > 0) notice["deadline_ms"] = now.count() + usr1_notice_s * int64_t{1000};
      }
      {
        MutexLock lock(settle_mu_);
        notice_reply_.clear();
        notice_source_ = notice["source"].get<std::string>();
      }
      bool noted = false;
      if (Send(wire::MessageType::kPreemption, notice.dump()).ok()) {
        MutexLock lock(settle_mu_);
        settle_cv_.WaitFor(settle_mu_, kNoticeAnswerTimeout, [this]() REQUIRES(settle_mu_) {
          return !notice_reply_.empty() || lost_;
        });
        noted = notice_reply_ == "noted";
      }
      // A SIGUSR1 while the group stops itself is not its end: the stop's SIGTERM comes.
      if (!noted && byte == 'T') EndBySigterm();
    }
  });
  return OkStatus();
}

Status WorkerClient::SendPreemptionNotice(std::string_view source, uint64_t deadline_ms) {
  wire::Preemption notice{.source = std::string(source), .deadline_ms = deadline_ms};
  if (notice.source.empty()) return InvalidArgumentError("a preemption notice needs a source");
  JT_ASSIGN_OR_RETURN(std::string body, wire::EncodeWorkerMessage(notice));
  return Send(wire::MessageType::kPreemption, body);
}

void WorkerClient::EndBySigterm() {
  signal(SIGTERM, SIG_DFL);
  kill(getpid(), SIGTERM);
  for (;;) pause();
}

void WorkerClient::OnPreemptionReply(const std::string& body) {
  const nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  const std::string kind = j.is_object() ? j.value("kind", "") : "";
  if (kind == "query") {
    uint64_t calls = 0;
    {
      MutexLock lock(settle_mu_);
      query_pending_ = true;  // the next call waits for the agreement
      calls = calls_;
    }
    const nlohmann::json answer = {{"calls", calls},
                                   {"rounds", rounds_.load(std::memory_order_relaxed)}};
    [[maybe_unused]] Status s = Send(wire::MessageType::kPreemption, answer.dump());
    return;
  }
  MutexLock lock(settle_mu_);
  if (kind == "agreed") {
    agreed_ = true;
    query_pending_ = false;
    sync_call_ = j.value("sync_call", uint64_t{0});
    agreement_ = body;
  } else if ((kind == "noted" || kind == "stop") && j.value("source", "") == notice_source_) {
    notice_reply_ = kind;  // the answer to the signal's notice, not to another source's
  }
  settle_cv_.NotifyAll();
}

std::string WorkerClient::PreemptionCall() {
  MutexLock lock(settle_mu_);
  ++calls_;
  settle_cv_.Wait(settle_mu_,
                  [this]() REQUIRES(settle_mu_) { return !query_pending_ || agreed_ || lost_; });
  return agreed_ && calls_ >= sync_call_ ? agreement_ : std::string();
}

}  // namespace jaxtrain::worker
