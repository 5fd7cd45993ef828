#include "worker/worker_client.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "wire/handshake.h"

namespace jaxtrain::worker {

StatusOr<std::unique_ptr<WorkerClient>> WorkerClient::Connect(const WorkerClientOptions& o) {
  JT_ASSIGN_OR_RETURN(int fd, wire::Connect(o.controller, o.timeout));
  std::unique_ptr<WorkerClient> client(new WorkerClient(fd));
  // Bound the handshake: a silent peer must not hold the worker forever. A zero timeval would
  // mean no bound at all, so the microseconds count and the bound is at least one.
  const auto usec = std::max<int64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(o.timeout).count(), 1);
  timeval tv{static_cast<time_t>(usec / 1'000'000), static_cast<suseconds_t>(usec % 1'000'000)};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));

  wire::Hello hello{.rank = o.rank,
                    .attempt = o.attempt,
                    .pid = static_cast<uint32_t>(getpid()),
                    .nonce = wire::GenerateNonce()};
  client->decoder_.set_max_body(wire::kChallengeSize);
  JT_RETURN_IF_ERROR(client->Send(wire::MessageType::kHello, wire::EncodeHello(hello)));
  auto challenge = client->ReadFrame();
  if (!challenge.ok() && challenge.status().code() == StatusCode::kDeadlineExceeded) {
    return DeadlineExceededError(
        "the controller at " + o.controller.ToString() + " did not answer the hello of rank " +
        std::to_string(o.rank) + " within " +
        std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(o.timeout).count()) +
        " ms");
  }
  if (!challenge.ok() || challenge->type != wire::MessageType::kChallenge ||
      challenge->body.size() != wire::kChallengeSize) {
    return UnauthenticatedError("the controller at " + o.controller.ToString() +
                                " refused this worker (rank " + std::to_string(o.rank) +
                                ", attempt " + std::to_string(o.attempt) +
                                ") or did not answer its hello");
  }
  wire::Nonce controller_nonce;
  std::memcpy(controller_nonce.data(), challenge->body.data(), wire::kNonceSize);
  if (!wire::MacEquals(wire::ControllerProof(o.secret, hello, controller_nonce),
                       std::string_view(challenge->body).substr(wire::kNonceSize))) {
    return UnauthenticatedError("the peer at " + o.controller.ToString() +
                                " could not prove it holds this run's secret; not trusting it");
  }
  wire::Mac proof = wire::WorkerProof(o.secret, hello, controller_nonce);
  JT_RETURN_IF_ERROR(
      client->Send(wire::MessageType::kAuth,
                   std::string_view(reinterpret_cast<const char*>(proof.data()), proof.size())));
  timeval none{0, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof(none));
  // A controller whose host vanishes (a network cut between hosts) ends this worker as a closed
  // connection does (WatchController), instead of leaving it behind. The controller reads
  // everything a worker sends at once, so unacknowledged reports mean it is gone.
  wire::EnableKeepAlive(fd, std::chrono::seconds(30));
  client->decoder_.set_max_body(size_t{1} << 31);
  return client;
}

WorkerClient::~WorkerClient() {
  Stop();
  close(fd_);
}

Status WorkerClient::Send(wire::MessageType type, std::string_view body) {
  std::string frame = wire::EncodeFrame(type, body);
  std::lock_guard<std::mutex> lock(send_mu_);
  return wire::WriteAll(fd_, frame);
}

StatusOr<wire::Frame> WorkerClient::ReadFrame() {
  char buf[65536];
  for (;;) {
    JT_ASSIGN_OR_RETURN(std::optional<wire::Frame> f, decoder_.Next());
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

Status WorkerClient::Register(std::string_view json) {
  return Send(wire::MessageType::kRegister, json);
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
  return Send(wire::MessageType::kReport, wire::EncodeReportBody(round, metrics_json));
}

Status WorkerClient::ReportCheckpoint(uint64_t round, std::string_view checkpoint_json,
                                      std::string_view metrics_json) {
  return Send(wire::MessageType::kReportCheckpoint,
              wire::EncodeCheckpointReportBody(round, checkpoint_json, metrics_json));
}

Status WorkerClient::SendError(std::string_view json) {
  return Send(wire::MessageType::kError, json);
}

Status WorkerClient::SendDone(std::string_view json) {
  return Send(wire::MessageType::kDone, json);
}

void WorkerClient::WatchController(int exit_code) {
  if (watcher_.joinable()) return;
  watcher_ = std::thread([this, exit_code] {
    char buf[4096];
    for (;;) {
      ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n > 0) continue;  // the controller sends nothing after the payload today
      break;
    }
    std::lock_guard<std::mutex> lock(send_mu_);
    if (stopping_) return;
    static const char kMessage[] =
        "jaxtrain worker: lost the connection to the controller; exiting\n";
    [[maybe_unused]] ssize_t w = write(2, kMessage, sizeof(kMessage) - 1);
    _exit(exit_code);
  });
}

void WorkerClient::Stop() {
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    stopping_ = true;
  }
  if (watcher_.joinable()) {
    shutdown(fd_, SHUT_RD);
    watcher_.join();
  }
}

}  // namespace jaxtrain::worker
