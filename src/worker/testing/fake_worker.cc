// fake_worker: a worker process without JAX or Python, for tests and benchmarks of the controller.
// It follows the message sequence of python/jaxtrain/worker/entry.py through the real WorkerClient.
//
//   fake_worker <mode> [rounds]
//
//   ok            register, wait for the start, report `rounds` rounds (default 1) of
//                 {"loss": 1/round, "rank": R}, send done, exit 0
//   raise         after the start, rank FAKE_FAIL_RANK sends an error with a traceback and exits 1
//   exit0         after the start, rank FAKE_FAIL_RANK exits 0 without sending done
//   crash         after the start, rank FAKE_FAIL_RANK kills itself with SIGKILL
//   crash-noticed rank FAKE_PEER_RANK (default FAKE_FAIL_RANK + 1) sends an error at once, as a
//                 peer noticing a lost collective does; rank FAKE_FAIL_RANK ignores the stop's
//                 SIGTERM and kills itself with SIGKILL then, so its death is seen after the
//                 peer's error (as when the controller reads the error first)
//   hang          every rank waits after the start
//   wrong-secret  connects with a wrong secret first, which must fail with kUnauthenticated;
//                 then runs as ok
//   duplicate     once registered, connects again as the same rank, which the controller must
//                 refuse (kUnauthenticated, "already connected"); then runs as ok
//   noconnect     rank FAKE_FAIL_RANK never connects; the others register and wait for the start
//   earlyexit     rank FAKE_FAIL_RANK exits 3 before it connects (as a worker that cannot); the
//                 others register and wait for the start
//
// Ranks that wait ("the others", hang) do so until a signal ends them, or until the controller's
// connection ends (WorkerClient::WatchController), as a real worker does.
//
// Environment: the JAXTRAIN_* variables the controller sets, and
//   FAKE_FAIL_RANK    the rank that fails (default 0)
//   FAKE_PEER_RANK    crash-noticed: the rank that reports the failure first
//   FAKE_EVENTS_FIFO  when set, each rank writes one byte to this FIFO at each step: 'P' once it
//                     has printed its pid, 'R' once registered, 'S' once started; so a test can act
//                     at a known point without sleeping
//   FAKE_GATE_FIFO    when set, each rank reads one byte from this FIFO after the start, before
//                     it reports or fails, so a test can hold the run at a known point
//   FAKE_CONNECT_GATE_FIFO  the same, before it connects to the controller
// The test keeps both FIFOs open read-write for the whole run, so no open() here blocks.
//
// Every rank first prints "fake_worker rank=R pid=P" so a test can find its process, unless
// FAKE_QUIET=1 (then no rank prints anything).
// Exit codes: 0 done; 1 failed as asked; 2 misuse or an unexpected error; 3 start-up failed as
// asked; 4 controller gone.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "wire/handshake.h"
#include "worker/worker_client.h"

namespace jaxtrain::worker {
namespace {

constexpr int kExitFailed = 1;
constexpr int kExitMisuse = 2;
constexpr int kExitStartUp = 3;
constexpr int kExitControllerLost = 4;

int Misuse(const std::string& why) {
  std::fprintf(stderr, "fake_worker: %s\n", why.c_str());
  return kExitMisuse;
}

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

[[noreturn]] void WaitToBeKilled() {
  for (;;) pause();
}

// One byte to or from a FIFO named by an environment variable; nothing when it is unset.
void SignalEvent(char event) {
  const char* path = std::getenv("FAKE_EVENTS_FIFO");
  if (path == nullptr) return;
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  [[maybe_unused]] ssize_t n = write(fd, &event, 1);
  close(fd);
}

void PassGate(const char* variable = "FAKE_GATE_FIFO") {
  const char* path = std::getenv(variable);
  if (path == nullptr) return;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  char byte;
  [[maybe_unused]] ssize_t n = read(fd, &byte, 1);
  close(fd);
}

// Output for the console tests: FAKE_OUTPUT_BYTES bytes in 1 KiB lines, then FAKE_PROGRESS as it
// is (a progress bar's '\r'-separated text, without a newline).
void PrintOutput() {
  const std::string line(1023, 'o');
  for (int left = EnvInt("FAKE_OUTPUT_BYTES", 0); left > 0; left -= 1024) {
    std::printf("%s\n", line.c_str());
  }
  if (const char* progress = std::getenv("FAKE_PROGRESS")) std::fputs(progress, stdout);
  std::fflush(stdout);
}

StatusOr<WorkerClientOptions> OptionsFromEnv() {
  const char* address = std::getenv("JAXTRAIN_CONTROLLER_ADDR");
  if (address == nullptr) return InvalidArgumentError("JAXTRAIN_CONTROLLER_ADDR must be set");
  WorkerClientOptions options;
  JT_ASSIGN_OR_RETURN(options.controller, wire::ParseHostPort(address));
  JT_ASSIGN_OR_RETURN(options.secret, TakeRunSecret());
  options.rank = static_cast<uint32_t>(EnvInt("JAXTRAIN_RANK", 0));
  options.attempt = static_cast<uint32_t>(EnvInt("JAXTRAIN_ATTEMPT", 0));
  return options;
}

int Run(const std::string& mode, int rounds) {
  const int rank = EnvInt("JAXTRAIN_RANK", 0);
  const bool failing_rank = rank == EnvInt("FAKE_FAIL_RANK", 0);
  if (EnvInt("FAKE_QUIET", 0) == 0) {
    std::printf("fake_worker rank=%d pid=%d\n", rank, static_cast<int>(getpid()));
    std::fflush(stdout);
  }
  SignalEvent('P');
  sigset_t sigterm;
  sigemptyset(&sigterm);
  sigaddset(&sigterm, SIGTERM);
  // Blocked before any thread starts, so that sigwait() below is the only taker.
  if (mode == "crash-noticed" && failing_rank) sigprocmask(SIG_BLOCK, &sigterm, nullptr);
  if (mode == "noconnect" && failing_rank) WaitToBeKilled();
  if (mode == "earlyexit" && failing_rank) return kExitStartUp;

  auto options = OptionsFromEnv();
  if (!options.ok()) return Misuse(options.status().ToString());
  if (mode == "wrong-secret") {
    WorkerClientOptions wrong = *options;
    wrong.secret[0] = static_cast<char>(wrong.secret[0] ^ 1);
    auto refused = WorkerClient::Connect(wrong);
    if (refused.ok() || refused.status().code() != StatusCode::kUnauthenticated) {
      return Misuse("connecting with a wrong secret: expected kUnauthenticated, got " +
                    refused.status().ToString());
    }
  }
  char host[256] = "";
  gethostname(host, sizeof(host) - 1);
  nlohmann::json registration = {{"host", host}, {"pid", getpid()}};
  // Rank 0 publishes a coordinator, as the controller requires; no JAX runs here to use it.
  if (rank == 0) registration["coordinator"] = "127.0.0.1:1";
  options->registration = registration.dump();
  PassGate("FAKE_CONNECT_GATE_FIFO");
  auto client = WorkerClient::Connect(*options);
  if (!client.ok()) return Misuse(client.status().ToString());
  SignalEvent('R');
  if (mode == "duplicate") {
    auto second = WorkerClient::Connect(*options);
    if (second.ok() || second.status().code() != StatusCode::kUnauthenticated ||
        second.status().message().find("already connected") == std::string::npos) {
      return Misuse("connecting twice as rank " + std::to_string(rank) +
                    ": expected kUnauthenticated, already connected; got " +
                    second.status().ToString());
    }
  }
  auto start = (*client)->WaitStart();
  if (!start.ok()) return kExitControllerLost;
  (*client)->WatchController(kExitControllerLost);
  SignalEvent('S');
  PrintOutput();
  PassGate();

  Status s;
  if (mode == "ok" || mode == "wrong-secret" || mode == "duplicate") {
    for (int round = 1; round <= rounds; ++round) {
      nlohmann::json metrics = {{"loss", 1.0 / round}, {"rank", rank}};
      s = (*client)->Report(static_cast<uint64_t>(round), metrics.dump());
      if (!s.ok()) return Misuse(s.ToString());
    }
    s = (*client)->SendDone("{}");
    return s.ok() ? 0 : Misuse(s.ToString());
  }
  const bool peer_rank = rank == EnvInt("FAKE_PEER_RANK", EnvInt("FAKE_FAIL_RANK", 0) + 1);
  if ((failing_rank && mode == "raise") || (peer_rank && mode == "crash-noticed")) {
    const std::string message = mode == "raise"
                                    ? "RuntimeError: fake failure on rank " + std::to_string(rank)
                                    : std::string("RuntimeError: a peer of the collective is gone");
    const std::string traceback =
        "Traceback (most recent call last):\n  File \"fake_worker\", in train\n" + message + "\n";
    std::fputs(traceback.c_str(), stderr);
    nlohmann::json error = {{"message", message}, {"traceback", traceback}, {"phase", "training"}};
    s = (*client)->SendError(error.dump());
    return s.ok() ? kExitFailed : Misuse(s.ToString());
  }
  // As os._exit(0) would: the connection closes as part of the exit, whose status is then final.
  if (failing_rank && mode == "malformed") {
    // Well-framed, authenticated, and of the wrong shape: a string where a number belongs.
    s = (*client)->SendError(R"({"message": 5, "traceback": [], "phase": {}})");
    if (!s.ok()) return Misuse(s.ToString());
  }
  if (failing_rank && mode == "exit0") _exit(0);
  if (failing_rank && mode == "crash") raise(SIGKILL);
  if (failing_rank && mode == "crash-noticed") {
    int signal = 0;
    sigwait(&sigterm, &signal);
    raise(SIGKILL);
  }
  WaitToBeKilled();
}

}  // namespace
}  // namespace jaxtrain::worker

int main(int argc, char** argv) {
  using jaxtrain::worker::Misuse;
  static const char* const kModes[] = {"ok",        "raise",        "exit0",        "crash",
                                       "hang",      "wrong-secret", "noconnect",    "malformed",
                                       "duplicate", "earlyexit",    "crash-noticed"};
  if (argc < 2 || argc > 3) return Misuse("usage: fake_worker <mode> [rounds]");
  const std::string mode = argv[1];
  bool known = false;
  for (const char* m : kModes) known = known || mode == m;
  if (!known) return Misuse("unknown mode '" + mode + "'");
  const int rounds = argc == 3 ? std::atoi(argv[2]) : 1;
  if (rounds < 0) return Misuse("rounds must be >= 0");
  return jaxtrain::worker::Run(mode, rounds);
}
