// The controller against real worker processes (src/worker/testing/fake_worker.cc) on loopback
// sockets. Nothing here sleeps: a test that must act at a known point of a run synchronises with
// the workers through FIFOs (FAKE_EVENTS_FIFO, FAKE_GATE_FIFO), and the start-up timeout runs on a
// FakeClock. kNoHang bounds every wait only so that a bug fails a test instead of hanging it.
#include "controller/controller.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "controller/testing/cpu_plan.h"
#include "launch/local_launcher.h"
#include "storage/checkpoint.h"
#include "storage/crc32c.h"
#include "storage/files.h"
#include "wire/frame.h"
#include "wire/handshake.h"
#include "wire/socket.h"

namespace jaxtrain::controller {
namespace {

using nlohmann::json;
using State = Outcome::State;

constexpr auto kNoHang = std::chrono::seconds(30);

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A FIFO that the test holds open read-write for the whole run, so that the workers' open() of it
// never blocks, whichever side comes first.
class Fifo {
 public:
  explicit Fifo(std::string path) : path_(std::move(path)) {
    EXPECT_EQ(mkfifo(path_.c_str(), 0600), 0) << std::strerror(errno);
    fd_ = open(path_.c_str(), O_RDWR | O_CLOEXEC);
    EXPECT_GE(fd_, 0) << std::strerror(errno);
  }
  ~Fifo() { close(fd_); }
  const std::string& path() const { return path_; }

  // Reads the workers' events until `count` of them, in all, have been `event`; false when they
  // stop coming.
  bool WaitFor(char event, int count) {
    while (seen_[event] < count) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(std::chrono::milliseconds(kNoHang).count())) != 1) {
        return false;
      }
      char byte;
      if (read(fd_, &byte, 1) != 1) return false;
      ++seen_[byte];
    }
    return true;
  }

  // Lets `count` workers through the gate.
  void Open(int count) { ASSERT_EQ(write(fd_, std::string(count, 'g').data(), count), count); }

 private:
  std::string path_;
  int fd_ = -1;
  std::map<char, int> seen_;
};

// A raw TCP connection to the control port.
class RawPeer {
 public:
  explicit RawPeer(int port) {
    auto fd = wire::Connect({"127.0.0.1", port}, kNoHang);
    EXPECT_TRUE(fd.ok()) << fd.status().ToString();
    fd_ = fd.ok() ? *fd : -1;
  }
  ~RawPeer() { close(fd_); }

  void Send(std::string_view bytes) { ASSERT_TRUE(wire::WriteAll(fd_, bytes).ok()); }

  // The next frame the controller sends, read with a bound on its body.
  std::optional<wire::Frame> ReadFrame(size_t max_body) {
    wire::FrameDecoder decoder(max_body);
    for (;;) {
      auto f = decoder.Next();
      if (!f.ok()) return std::nullopt;
      if (f->has_value()) return **f;
      std::string chunk = Receive();
      if (chunk.empty() || !decoder.Feed(chunk).ok()) return std::nullopt;
    }
  }

  // True once the controller has closed the connection (an end of file or a reset).
  bool ClosedByController() {
    for (;;) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(std::chrono::milliseconds(kNoHang).count())) != 1) {
        return false;
      }
      char buf[256];
      ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
      if (n < 0) return false;
    }
  }

 private:
  std::string Receive() {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(std::chrono::milliseconds(kNoHang).count())) != 1) return "";
    char buf[256];
    ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
  }

  int fd_ = -1;
};

// A frame whose body is known to fit.
std::string Frame(wire::MessageType type, std::string_view body) {
  return wire::EncodeFrame(type, body).value();
}

std::string RawHeader(uint32_t length, uint8_t type) {
  std::string header;
  for (int shift = 24; shift >= 0; shift -= 8) header.push_back(static_cast<char>(length >> shift));
  header.push_back(static_cast<char>(type));
  return header;
}

// Returns once the controller's event loop has handled every frame that had reached it before this
// call: a peer it refuses is read only in a loop step that began after the peer connected, and a
// step reads every connection that has data before it checks its timers.
void SyncWithEventLoop(int port) {
  RawPeer peer(port);
  peer.Send(RawHeader(0, 0));  // a frame of length 0 is refused at once
  EXPECT_TRUE(peer.ClosedByController());
}

// An attacker on this host: keeps `count` connections to the control port open that never send a
// byte, and opens a new one for each the controller closes, until destroyed. Bounded: `count`
// connections at a time, for the life of the test.
class IdleFlood {
 public:
  IdleFlood(int port, int count) : port_(port) {
    for (int i = 0; i < count; ++i) fds_.push_back(Open());
    thread_ = std::thread([this] { Run(); });
  }
  ~IdleFlood() {
    stop_ = true;
    thread_.join();
    for (int fd : fds_) close(fd);
  }

  // Waits until the controller has closed `n` of the flood's connections (it holds no more than
  // its cap of unproven ones); false if it does not.
  bool WaitForClosed(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kNoHang, [&] { return closed_ >= n; });
  }

 private:
  int Open() const {
    auto fd = wire::Connect({"127.0.0.1", port_}, kNoHang);
    return fd.ok() ? *fd : -1;
  }

  void Run() {
    while (!stop_) {
      std::vector<pollfd> polled;
      for (int fd : fds_) polled.push_back({fd, POLLIN, 0});
      // A bounded wait, only so that the destructor is noticed.
      if (poll(polled.data(), polled.size(), 50) <= 0) continue;
      for (size_t i = 0; i < polled.size(); ++i) {
        if (polled[i].revents == 0) continue;
        char byte;
        if (recv(fds_[i], &byte, 1, MSG_DONTWAIT) > 0) continue;
        close(fds_[i]);
        fds_[i] = Open();
        std::lock_guard<std::mutex> lock(mu_);
        ++closed_;
        cv_.notify_all();
      }
    }
  }

  const int port_;
  std::vector<int> fds_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  int closed_ = 0;
  std::thread thread_;
};

class ControllerTest : public testing::Test {
 protected:
  void SetUp() override {
    std::string dir = testing::TempDir() + "/controller_test.XXXXXX";
    ASSERT_NE(mkdtemp(dir.data()), nullptr) << std::strerror(errno);
    dir_ = dir;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // A CPU plan of `workers` fake_worker processes started with `args`.
  ControllerOptions Options(int workers, std::vector<std::string> args) {
    ControllerOptions options;
    options.run_dir = RunDir();
    options.experiment_name = "controller_test";
    options.plan = CpuPlan(workers);
    options.worker_argv = {FAKE_WORKER_PATH};
    options.worker_argv.insert(options.worker_argv.end(), args.begin(), args.end());
    options.console_fd = -1;
    options.terminate_grace = std::chrono::seconds(1);
    return options;
  }

  static std::unique_ptr<Controller> Make(ControllerOptions options,
                                          const Clock& clock = RealClock()) {
    return std::make_unique<Controller>(std::move(options),
                                        std::make_unique<launch::LocalLauncher>(), clock);
  }

  static void StartAndWait(Controller& controller) {
    Status s = controller.Start();
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_TRUE(controller.Wait(kNoHang)) << "the run did not end";
  }

  std::string RunDir() const { return dir_ + "/run"; }
  std::string RunFile(const std::string& name) const { return ReadFile(RunDir() + "/" + name); }
  json RunState() const { return json::parse(RunFile("run.json"), nullptr, false); }

  // The pid of every worker that got as far as printing it ("fake_worker rank=R pid=P").
  std::vector<pid_t> WorkerPids(int workers) const {
    std::vector<pid_t> pids;
    for (int r = 0; r < workers; ++r) {
      std::string log = RunFile("logs/rank-" + std::to_string(r) + ".log");
      size_t at = log.find(" pid=");
      if (at != std::string::npos) pids.push_back(std::atoi(log.c_str() + at + 5));
    }
    return pids;
  }

  // Every worker of the run has ended and been reaped: its pid no longer exists.
  void ExpectWorkersGone(const std::vector<pid_t>& pids) const {
    for (pid_t pid : pids) {
      EXPECT_EQ(kill(pid, 0), -1) << "worker process " << pid << " is still there";
      EXPECT_EQ(errno, ESRCH);
    }
  }

  std::string dir_;
};

TEST_F(ControllerTest, SucceedsAndRecordsEveryRound) {
  auto controller = Make(Options(4, {"ok", "5"}));
  ASSERT_NO_FATAL_FAILURE(StartAndWait(*controller));

  const Outcome& out = controller->outcome();
  EXPECT_EQ(out.state, State::kSucceeded);
  EXPECT_FALSE(out.failure.has_value());
  EXPECT_TRUE(out.warnings.empty());
  EXPECT_EQ(out.rounds, 5u);
  json last = json::parse(out.last_metrics_json, nullptr, false);
  EXPECT_EQ(last.value("rank", -1), 0) << out.last_metrics_json;
  EXPECT_DOUBLE_EQ(last.value("loss", 0.0), 1.0 / 5);

  std::vector<std::string> results = Lines(RunFile("result.jsonl"));
  ASSERT_EQ(results.size(), 5u);
  for (size_t i = 0; i < results.size(); ++i) {
    json line = json::parse(results[i], nullptr, false);
    EXPECT_EQ(line.value("round", 0), static_cast<int>(i) + 1) << results[i];
    EXPECT_EQ(line["metrics"].value("rank", -1), 0) << results[i];
  }
  std::vector<std::string> progress = Lines(RunFile("progress.csv"));
  ASSERT_EQ(progress.size(), 6u);
  EXPECT_EQ(progress[0], "jaxtrain/round,jaxtrain/time,loss,rank");

  json state = RunState();
  EXPECT_EQ(state.value("status", ""), "FINISHED");
  EXPECT_EQ(state.value("rounds", 0), 5);
  EXPECT_EQ(state.value("world_size", 0), 4);
  EXPECT_FALSE(std::filesystem::exists(RunDir() + "/error.txt"));
  EXPECT_EQ(WorkerPids(4).size(), 4u);
}

TEST_F(ControllerTest, ARankThatRaisesFailsTheRunWithItsTraceback) {
  ControllerOptions options = Options(4, {"raise"});
  options.worker_env["FAKE_FAIL_RANK"] = "2";
  auto controller = Make(std::move(options));
  ASSERT_NO_FATAL_FAILURE(StartAndWait(*controller));

  const Outcome& out = controller->outcome();
  EXPECT_EQ(out.state, State::kFailed);
  ASSERT_TRUE(out.failure.has_value());
  const RankFailure& f = *out.failure;
  EXPECT_EQ(f.rank, 2);
  EXPECT_EQ(f.attempt, 0);
  EXPECT_EQ(f.cause, FailureCause::kException);
  EXPECT_EQ(f.message, "RuntimeError: fake failure on rank 2");
  EXPECT_TRUE(Contains(f.traceback, "Traceback (most recent call last)")) << f.traceback;
  EXPECT_EQ(f.log_path, RunDir() + "/logs/rank-2.log");
  EXPECT_TRUE(Contains(f.log_tail, "RuntimeError: fake failure on rank 2")) << f.log_tail;

  std::string error = RunFile("error.txt");
  EXPECT_TRUE(Contains(error, "rank 2")) << error;
  EXPECT_TRUE(Contains(error, f.traceback)) << error;
  json state = RunState();
  EXPECT_EQ(state.value("status", ""), "ERRORED");
  EXPECT_EQ(state["attempts"][0]["failure"].value("rank", -1), 2);
  EXPECT_EQ(state["attempts"][0]["failure"].value("cause", ""), "exception");

  // The other ranks were waiting to be killed: the run ended, so they were.
  std::vector<pid_t> pids = WorkerPids(4);
  EXPECT_EQ(pids.size(), 4u);
  ExpectWorkersGone(pids);
}

TEST_F(ControllerTest, AWorkerKilledBySignalIsNamed) {
  ControllerOptions options = Options(3, {"crash"});
  options.worker_env["FAKE_FAIL_RANK"] = "1";
  auto controller = Make(std::move(options));
  ASSERT_NO_FATAL_FAILURE(StartAndWait(*controller));

  const Outcome& out = controller->outcome();
  EXPECT_EQ(out.state, State::kFailed);
  ASSERT_TRUE(out.failure.has_value());
  EXPECT_EQ(out.failure->rank, 1);
  EXPECT_EQ(out.failure->cause, FailureCause::kSignal);
  EXPECT_EQ(out.failure->signal, SIGKILL);
  EXPECT_EQ(out.failure->exit_code, -1);
  EXPECT_TRUE(Contains(out.failure->message, "SIGKILL")) << out.failure->message;
  ExpectWorkersGone(WorkerPids(3));
}

// A rank killed from outside is blamed, not the peer whose error about the lost collective the
// controller happened to read first.
TEST_F(ControllerTest, AKilledRankIsBlamedOverAPeerThatNoticedItFirst) {
  ControllerOptions options = Options(4, {"crash-noticed"});
  options.worker_env["FAKE_FAIL_RANK"] = "2";
  auto controller = Make(std::move(options));
  ASSERT_NO_FATAL_FAILURE(StartAndWait(*controller));

  const Outcome& out = controller->outcome();
  ASSERT_TRUE(out.failure.has_value());
  EXPECT_EQ(out.failure->rank, 2);
  EXPECT_EQ(out.failure->cause, FailureCause::kSignal);
  EXPECT_EQ(out.failure->signal, SIGKILL);
  EXPECT_EQ(out.failure->log_path, RunDir() + "/logs/rank-2.log");
  EXPECT_TRUE(Contains(out.failure->message,
                       "(SIGKILL); rank 3 failed meanwhile: RuntimeError: a "
                       "peer of the collective is gone"))
      << out.failure->message;
  EXPECT_EQ(RunState()["attempts"][0]["failure"].value("rank", -1), 2);
  // Each rank's host is recorded with the attempt (the dashboard shows it).
  const json hosts = RunState()["attempts"][0]["hosts"];
  ASSERT_EQ(hosts.size(), 4u) << hosts;
  for (const json& host : hosts) EXPECT_FALSE(host.get<std::string>().empty()) << hosts;
  ExpectWorkersGone(WorkerPids(4));
}

TEST_F(ControllerTest, RanksThatNeverPrintGetTheirLogsWhenTheAttemptEnds) {
  ControllerOptions options = Options(3, {"crash"});
  options.worker_env["FAKE_FAIL_RANK"] = "1";
  options.worker_env["FAKE_QUIET"] = "1";
  auto controller = Make(std::move(options));
  ASSERT_NO_FATAL_FAILURE(StartAndWait(*controller));

  const Outcome& out = controller->outcome();
  ASSERT_TRUE(out.failure.has_value());
  EXPECT_EQ(out.failure->rank, 1);
  // No rank printed: each log was created when the attempt ended, with its header, so the path
  // the failure names is a file and every log numbers the attempt.
  EXPECT_EQ(out.failure->log_path, RunDir() + "/logs/rank-1.log");
  EXPECT_EQ(out.failure->log_tail, "===== jaxtrain: attempt 0 =====\n");
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(RunFile("logs/rank-" + std::to_string(r) + ".log"),
              "===== jaxtrain: attempt 0 =====\n");
  }
  EXPECT_TRUE(Contains(RunFile("error.txt"), "--- last lines of " + out.failure->log_path))
      << RunFile("error.txt");
}

TEST_F(ControllerTest, AWorkerThatExitsZeroEarlyIsAFailure) {
  ControllerOptions options = Options(2, {"exit0"});
  options.worker_env["FAKE_FAIL_RANK"] = "1";
  auto controller = Make(std::move(options));
  ASSERT_NO_FATAL_FAILURE(StartAndWait(*controller));

  const Outcome& out = controller->outcome();
  EXPECT_EQ(out.state, State::kFailed);
  ASSERT_TRUE(out.failure.has_value());
  EXPECT_EQ(out.failure->rank, 1);
  EXPECT_EQ(out.failure->cause, FailureCause::kExit);
  EXPECT_EQ(out.failure->exit_code, 0);
  EXPECT_EQ(out.failure->signal, 0);
  EXPECT_TRUE(Contains(out.failure->message, "before its training function returned"))
      << out.failure->message;
  ExpectWorkersGone(WorkerPids(2));
}

TEST_F(ControllerTest, AMalformedMessageFromAnAuthenticatedWorkerFailsItsRank) {
  ControllerOptions options = Options(2, {"malformed"});
  options.worker_env["FAKE_FAIL_RANK"] = "1";
  auto controller = Make(std::move(options));
  ASSERT_NO_FATAL_FAILURE(StartAndWait(*controller));

  const Outcome& out = controller->outcome();
  EXPECT_EQ(out.state, State::kFailed);
  ASSERT_TRUE(out.failure.has_value());
  EXPECT_EQ(out.failure->rank, 1);
  EXPECT_EQ(out.failure->cause, FailureCause::kConnection);
  EXPECT_TRUE(Contains(out.failure->message, "protocol error: malformed message of type 8"))
      << out.failure->message;
  ExpectWorkersGone(WorkerPids(2));
}

TEST_F(ControllerTest, AbortStopsEveryRunningWorker) {
  Fifo events(dir_ + "/events");
  ControllerOptions options = Options(3, {"hang"});
  options.worker_env["FAKE_EVENTS_FIFO"] = events.path();
  auto controller = Make(std::move(options));
  ASSERT_TRUE(controller->Start().ok());
  ASSERT_TRUE(events.WaitFor('S', 3)) << "the workers did not all start";

  controller->Abort("test");
  ASSERT_TRUE(controller->Wait(kNoHang));
  const Outcome& out = controller->outcome();
  EXPECT_EQ(out.state, State::kAborted);
  EXPECT_EQ(out.abort_reason, "test");
  EXPECT_FALSE(out.failure.has_value());
  EXPECT_EQ(RunState().value("status", ""), "ABORTED");
  std::vector<pid_t> pids = WorkerPids(3);
  EXPECT_EQ(pids.size(), 3u);
  ExpectWorkersGone(pids);
}

TEST_F(ControllerTest, AbortRightAfterStartStopsEveryWorker) {
  auto controller = Make(Options(3, {"hang"}));
  ASSERT_TRUE(controller->Start().ok());
  controller->Abort("test");
  controller->Abort("a second reason is ignored");
  ASSERT_TRUE(controller->Wait(kNoHang));

  const Outcome& out = controller->outcome();
  EXPECT_EQ(out.state, State::kAborted);
  EXPECT_EQ(out.abort_reason, "test");
  EXPECT_FALSE(out.failure.has_value());
  ExpectWorkersGone(WorkerPids(3));
}

// Bytes this process has read so far, all threads together (/proc/self/io's rchar).
uint64_t BytesReadByThisProcess() {
  std::istringstream io(ReadFile("/proc/self/io"));
  for (std::string key; io >> key;) {
    uint64_t value = 0;
    io >> value;
    if (key == "rchar:") return value;
  }
  return 0;
}

// A restart verifies the checkpoint it restores from off the loop: an Abort() that comes while a
// large checkpoint is still being read ends the run at once, not once the whole file is read.
TEST_F(ControllerTest, AbortWhileARestartVerifiesALargeCheckpointEndsTheRunPromptly) {
  // A checkpoint of an earlier run under the same name, small at first: the first attempt's
  // verification (in Start()) takes no time.
  const std::string run = RunDir();
  const std::string staged = storage::StagingPath(run, 0, 1, 0);
  std::filesystem::create_directories(staged);
  { std::ofstream(staged + "/model.bin") << "weights"; }
  storage::RankCheckpoint part{.rank = 0, .staging_dir = staged};
  part.files.push_back(
      {.path = "model.bin", .size = 7, .crc32c = storage::Crc32c(0, "weights", 7)});
  auto record = storage::CommitCheckpoint(run, "checkpoint_000001", 1, 1.0, "{}", {part});
  ASSERT_TRUE(record.ok()) << record.status().ToString();
  std::vector<std::string> warnings;
  auto index = storage::CheckpointIndex::Load(run, &warnings);
  ASSERT_TRUE(index.ok() && index->Save().ok());

  Fifo gate(dir_ + "/gate");
  Fifo events(dir_ + "/events");
  ControllerOptions options = Options(2, {"raise"});
  options.worker_env["FAKE_GATE_FIFO"] = gate.path();
  options.worker_env["FAKE_EVENTS_FIFO"] = events.path();
  options.max_failures = 1;
  auto controller = Make(std::move(options));
  ASSERT_TRUE(controller->Start().ok());
  ASSERT_TRUE(events.WaitFor('S', 2)) << "the workers did not all start";

  // Now the checkpoint grows to a sparse TiB, its manifest to match: reading it all takes minutes.
  const std::string dir = run + "/checkpoint_000001";
  ASSERT_EQ(truncate((dir + "/model.bin").c_str(), off_t{1} << 40), 0) << std::strerror(errno);
  json manifest = json::parse(ReadFile(dir + "/" + storage::kManifestName));
  manifest["file_list"][0]["size"] = uint64_t{1} << 40;
  ASSERT_TRUE(
      storage::WriteFileAtomically(dir + "/" + storage::kManifestName, manifest.dump()).ok());

  // Rank 0 fails; the restart reads the checkpoint. Abort once a GiB of it has been read.
  const uint64_t before = BytesReadByThisProcess();
  gate.Open(2);
  const auto give_up = std::chrono::steady_clock::now() + kNoHang;
  while (BytesReadByThisProcess() - before < (uint64_t{1} << 30)) {
    ASSERT_LT(std::chrono::steady_clock::now(), give_up)
        << "the restart did not read the checkpoint";
    std::this_thread::yield();
  }
  controller->Abort("test");
  ASSERT_TRUE(controller->Wait(kNoHang)) << "the abort waited for the verification";

  const Outcome& out = controller->outcome();
  EXPECT_EQ(out.state, State::kAborted);
  EXPECT_EQ(out.abort_reason, "test");
  EXPECT_EQ(out.attempts, 1) << "no second attempt was started";
  EXPECT_EQ(RunState().value("status", ""), "ABORTED");
  ExpectWorkersGone(WorkerPids(2));
}

TEST_F(ControllerTest, DestroyingARunningControllerStopsEveryWorker) {
  Fifo events(dir_ + "/events");
  ControllerOptions options = Options(2, {"hang"});
  options.worker_env["FAKE_EVENTS_FIFO"] = events.path();
  auto controller = Make(std::move(options));
  ASSERT_TRUE(controller->Start().ok());
  ASSERT_TRUE(events.WaitFor('S', 2)) << "the workers did not all start";

  controller.reset();
  EXPECT_EQ(RunState().value("status", ""), "ABORTED");
  std::vector<pid_t> pids = WorkerPids(2);
  EXPECT_EQ(pids.size(), 2u);
  ExpectWorkersGone(pids);
}

TEST_F(ControllerTest, StartUpTimeoutNamesTheMissingRank) {
  FakeClock clock;
  Fifo events(dir_ + "/events");
  ControllerOptions options = Options(3, {"noconnect"});
  options.worker_env["FAKE_FAIL_RANK"] = "1";
  options.worker_env["FAKE_EVENTS_FIFO"] = events.path();
  options.start_timeout = std::chrono::milliseconds(100);
  options.max_start_failures = 0;
  auto controller = Make(std::move(options), clock);
  ASSERT_TRUE(controller->Start().ok());
  ASSERT_TRUE(events.WaitFor('P', 3)) << "the worker processes did not all come up";
  ASSERT_TRUE(events.WaitFor('R', 2)) << "ranks 0 and 2 did not register";
  SyncWithEventLoop(controller->port());  // so that the controller has seen them register

  clock.Advance(std::chrono::seconds(1));
  ASSERT_TRUE(controller->Wait(kNoHang));
  const Outcome& out = controller->outcome();
  EXPECT_EQ(out.state, State::kFailed);
  ASSERT_TRUE(out.failure.has_value());
  EXPECT_EQ(out.failure->rank, 1);
  EXPECT_EQ(out.failure->cause, FailureCause::kStartUp);
  EXPECT_TRUE(Contains(out.failure->message, "start-up timeout")) << out.failure->message;
  std::vector<pid_t> pids = WorkerPids(3);
  EXPECT_EQ(pids.size(), 3u);
  ExpectWorkersGone(pids);
}

TEST_F(ControllerTest, APeerWithoutTheSecretIsRefusedAndTheRunIsUnaffected) {
  // Each worker first connects with a wrong secret and exits 2 unless that is refused.
  auto controller = Make(Options(2, {"wrong-secret", "3"}));
  ASSERT_NO_FATAL_FAILURE(StartAndWait(*controller));

  const Outcome& out = controller->outcome();
  EXPECT_EQ(out.state, State::kSucceeded);
  EXPECT_FALSE(out.failure.has_value()) << out.failure->message;
  EXPECT_EQ(out.rounds, 3u);
}

TEST_F(ControllerTest, AConsoleThatNobodyReadsNeverStopsTheRun) {
  // 4 MiB per rank into a pipe that holds 64 KiB and that nobody reads: a blocking write would
  // stop the loop (no report, no reaping) and the run would never end.
  int console[2];
  ASSERT_EQ(pipe2(console, O_CLOEXEC), 0);
  ControllerOptions options = Options(2, {"ok", "3"});
  options.worker_env["FAKE_OUTPUT_BYTES"] = std::to_string(4 << 20);
  options.console_fd = console[1];
  auto controller = Make(std::move(options));
  StartAndWait(*controller);
  EXPECT_EQ(controller->outcome().state, State::kSucceeded);
  EXPECT_EQ(controller->outcome().rounds, 3u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_GE(RunFile("logs/rank-" + std::to_string(r) + ".log").size(), 4u << 20)
        << "every line is in the rank's log";
  }
  controller.reset();
  close(console[0]);
  close(console[1]);
}

TEST_F(ControllerTest, AProgressBarReachesTheConsoleBeforeItsLineEnds) {
  Fifo gate(dir_ + "/gate");
  Fifo events(dir_ + "/events");
  const std::string console_path = dir_ + "/console";
  int console = open(console_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ASSERT_GE(console, 0);
  ControllerOptions options = Options(1, {"ok", "1"});
  options.worker_env["FAKE_PROGRESS"] = "\rstep 1/2\rstep 2/2\r";
  options.worker_env["FAKE_GATE_FIFO"] = gate.path();
  options.worker_env["FAKE_EVENTS_FIFO"] = events.path();
  options.console_fd = console;
  auto controller = Make(std::move(options));
  ASSERT_TRUE(controller->Start().ok());
  ASSERT_TRUE(events.WaitFor('S', 1));
  // The worker now waits at the gate, its bar printed and no newline after it.
  const std::string bar = "(rank=0) step 1/2\r(rank=0) step 2/2\r";
  auto deadline = std::chrono::steady_clock::now() + kNoHang;
  while (!Contains(ReadFile(console_path), bar) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(Contains(ReadFile(console_path), bar)) << ReadFile(console_path);
  gate.Open(1);
  ASSERT_TRUE(controller->Wait(kNoHang));
  EXPECT_EQ(controller->outcome().state, State::kSucceeded);
  controller.reset();
  close(console);
}

TEST_F(ControllerTest, PeersThatFailTheHandshakeAreDisconnectedAndTheRunIsUnaffected) {
  // The workers wait at the gate after the start, so the run is in progress throughout.
  Fifo gate(dir_ + "/gate");
  ControllerOptions options = Options(2, {"ok", "3"});
  options.worker_env["FAKE_GATE_FIFO"] = gate.path();
  auto controller = Make(std::move(options));
  ASSERT_TRUE(controller->Start().ok());
  const int port = controller->port();

  RawPeer http(port);
  http.Send("GET / HTTP/1.1\r\nHost: localhost\r\n\r\n");
  RawPeer oversized(port);
  oversized.Send(RawHeader(0xffffffff, static_cast<uint8_t>(wire::MessageType::kHello)));
  RawPeer unknown_type(port);
  unknown_type.Send(RawHeader(wire::kHelloSize + 1, 200));
  RawPeer not_a_hello(port);
  not_a_hello.Send(Frame(wire::MessageType::kRegister, "{}"));
  RawPeer bad_rank(port);
  bad_rank.Send(Frame(
      wire::MessageType::kHello,
      wire::EncodeHello({.rank = 99, .nonce = wire::GenerateNonce()}, wire::GenerateSecret())));
  // A hello made without the secret is refused at once, with a reason and without a challenge;
  // an auth frame after it is never read.
  RawPeer no_secret(port);
  no_secret.Send(Frame(
      wire::MessageType::kHello,
      wire::EncodeHello({.rank = 0, .nonce = wire::GenerateNonce()}, wire::GenerateSecret())));
  std::optional<wire::Frame> refusal = no_secret.ReadFrame(256);
  ASSERT_TRUE(refusal.has_value());
  EXPECT_EQ(refusal->type, wire::MessageType::kRefused);
  EXPECT_TRUE(Contains(refusal->body, "secret")) << refusal->body;
  // Peers that stop halfway through a hello, or say nothing, are left to the handshake timeout.
  RawPeer truncated(port);
  truncated.Send(
      Frame(wire::MessageType::kHello, std::string(wire::kHelloSize, 'J')).substr(0, 20));
  RawPeer silent(port);

  EXPECT_TRUE(http.ClosedByController());
  EXPECT_TRUE(oversized.ClosedByController());
  EXPECT_TRUE(unknown_type.ClosedByController());
  EXPECT_TRUE(not_a_hello.ClosedByController());
  EXPECT_TRUE(bad_rank.ClosedByController());
  EXPECT_TRUE(no_secret.ClosedByController());

  gate.Open(2);
  ASSERT_TRUE(controller->Wait(kNoHang));
  const Outcome& out = controller->outcome();
  EXPECT_EQ(out.state, State::kSucceeded);
  EXPECT_FALSE(out.failure.has_value()) << out.failure->message;
  EXPECT_EQ(out.rounds, 3u);
}

TEST_F(ControllerTest, ASecondControllerOfALiveRunIsRefusedNamingTheFirst) {
  Fifo events(dir_ + "/events");
  ControllerOptions options = Options(2, {"hang"});
  options.worker_env["FAKE_EVENTS_FIFO"] = events.path();
  auto first = Make(options);
  ASSERT_TRUE(first->Start().ok());
  ASSERT_TRUE(events.WaitFor('S', 2)) << "the workers did not all start";

  auto second = Make(Options(2, {"ok"}));
  Status s = second->Start();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), "pid " + std::to_string(getpid()))) << s.message();
  // The first run's files are untouched: still its RUNNING record.
  EXPECT_EQ(RunState().value("status", ""), "RUNNING");

  first->Abort("test");
  ASSERT_TRUE(first->Wait(kNoHang));
  EXPECT_EQ(RunState().value("status", ""), "ABORTED");
  // Once the first has ended, the run can be resumed at once, in the same process.
  auto third = Make(Options(2, {"ok"}));
  ASSERT_NO_FATAL_FAILURE(StartAndWait(*third));
  EXPECT_EQ(third->outcome().state, State::kSucceeded);
}

TEST_F(ControllerTest, AnAttemptLeftRunningByAKilledDriverIsMarkedCrashed) {
  ASSERT_TRUE(std::filesystem::create_directories(RunDir()));
  {
    std::ofstream run_json(RunDir() + "/run.json");
    run_json << json{{"status", "RUNNING"},
                     {"attempts", json::array({{{"attempt", 0}, {"status", "RUNNING"}}})}}
                    .dump();
    std::ofstream lock(RunDir() + "/LOCK");
    lock << R"({"host":"gone-host","pid":4242,"since":0})";
  }
  auto controller = Make(Options(2, {"ok"}));
  ASSERT_NO_FATAL_FAILURE(StartAndWait(*controller));
  EXPECT_EQ(controller->outcome().state, State::kSucceeded);
  json state = RunState();
  EXPECT_EQ(state.value("status", ""), "FINISHED");
  ASSERT_EQ(state["attempts"].size(), 2u) << state.dump();
  const json& crashed = state["attempts"][0];
  EXPECT_EQ(crashed.value("status", ""), "CRASHED");
  EXPECT_EQ(crashed["failure"].value("cause", ""), "driver");
  EXPECT_TRUE(Contains(crashed["failure"].value("message", ""), "host gone-host, pid 4242"))
      << crashed.dump();
  EXPECT_EQ(state["attempts"][1].value("status", ""), "FINISHED");
}

TEST_F(ControllerTest, AReportRoundThatCannotBeRecordedFailsTheRun) {
  // result.jsonl on a device that is always full (ENOSPC), as on a full disk.
  ASSERT_TRUE(std::filesystem::create_directories(RunDir()));
  ASSERT_EQ(symlink("/dev/full", (RunDir() + "/result.jsonl").c_str()), 0);
  auto controller = Make(Options(2, {"ok", "3"}));
  ASSERT_NO_FATAL_FAILURE(StartAndWait(*controller));
  const Outcome& out = controller->outcome();
  ASSERT_EQ(out.state, State::kFailed);
  ASSERT_TRUE(out.failure.has_value());
  EXPECT_EQ(out.failure->cause, FailureCause::kStorage);
  EXPECT_EQ(out.failure->rank, -1);
  EXPECT_TRUE(Contains(out.failure->message, "report round 1 could not be recorded"))
      << out.failure->message;
  EXPECT_TRUE(Contains(out.failure->message, "result.jsonl")) << out.failure->message;
  EXPECT_EQ(out.rounds, 0u);
  EXPECT_EQ(out.last_metrics_json, "");
  EXPECT_EQ(out.failure->status_code, StatusCode::kResourceExhausted);
  json state = RunState();
  EXPECT_EQ(state.value("status", ""), "ERRORED");
  EXPECT_EQ(state["attempts"][0]["failure"].value("cause", ""), "storage");
  EXPECT_EQ(state["attempts"][0]["failure"].value("status_code", ""), "RESOURCE_EXHAUSTED");
}

TEST_F(ControllerTest, AFullDiskIsRetriedABoundedNumberOfTimesEvenWithoutRestarts) {
  ASSERT_TRUE(std::filesystem::create_directories(RunDir()));
  ASSERT_EQ(symlink("/dev/full", (RunDir() + "/result.jsonl").c_str()), 0);
  auto controller = Make(Options(2, {"ok", "3"}));  // max_failures = 0
  ASSERT_NO_FATAL_FAILURE(StartAndWait(*controller));
  const Outcome& out = controller->outcome();
  ASSERT_EQ(out.state, State::kFailed);
  ASSERT_EQ(out.failures.size(), size_t{FailurePolicy::kMaxStorageFailures + 1});
  for (const RankFailure& f : out.failures) EXPECT_EQ(f.cause, FailureCause::kStorage);
  EXPECT_TRUE(out.failures.front().retried) << out.failures.front().decision;
  EXPECT_FALSE(out.failures.back().retried);
  EXPECT_TRUE(Contains(out.failures.back().decision, "storage retry limit"))
      << out.failures.back().decision;
  json attempts = RunState()["attempts"];
  ASSERT_EQ(attempts.size(), out.failures.size());
  EXPECT_EQ(attempts[0]["failure"]["decision"].value("action", ""), "retry");
  EXPECT_EQ(attempts.back()["failure"]["decision"].value("action", ""), "raise");
}

// The controller says why it gives up in words; the status code only when verbose.
class UnrecordableRoundTest : public ControllerTest, public testing::WithParamInterface<bool> {};

TEST_P(UnrecordableRoundTest, ARoundThatCanNeverBeRecordedIsNotRetried) {
  // result.jsonl is a directory: no retry can append to it.
  ASSERT_TRUE(std::filesystem::create_directories(RunDir() + "/result.jsonl"));
  ControllerOptions options = Options(2, {"ok", "3"});
  options.max_failures = -1;
  options.verbose = GetParam();
  auto controller = Make(std::move(options));
  testing::internal::CaptureStderr();
  StartAndWait(*controller);
  const std::string said = testing::internal::GetCapturedStderr();
  ASSERT_FALSE(HasFatalFailure());
  const Outcome& out = controller->outcome();
  ASSERT_EQ(out.state, State::kFailed);
  ASSERT_EQ(out.failures.size(), 1u);
  EXPECT_EQ(out.failure->cause, FailureCause::kStorage);
  EXPECT_EQ(out.failure->status_code, StatusCode::kFailedPrecondition);
  EXPECT_EQ(out.failure->decision,
            "retrying cannot help (the run directory is not in a state to allow it)");
  const std::string line =
      "jaxtrain: not restarting: retrying cannot help (the run directory is not in a state to "
      "allow it)";
  EXPECT_TRUE(Contains(said, GetParam() ? line + " [FAILED_PRECONDITION]\n" : line + "\n")) << said;
}

INSTANTIATE_TEST_SUITE_P(Verbose, UnrecordableRoundTest, testing::Bool());

TEST_F(ControllerTest, ARunWhoseRecordCannotBeWrittenNeverSucceeds) {
  // run.json's temporary file cannot be created: every write of run.json fails.
  ASSERT_TRUE(std::filesystem::create_directories(RunDir()));
  auto controller = Make(Options(1, {"ok"}));
  ASSERT_EQ(mkdir((RunDir() + "/run.json.tmp." + std::to_string(getpid())).c_str(), 0755), 0);
  Status s = controller->Start();
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(Contains(s.message(), "run.json")) << s.ToString();
}

// ~150 idle connections, re-opened as the controller closes them, used to fill the cap
// of unauthenticated connections so that the workers were refused and every attempt failed.
TEST_F(ControllerTest, AFloodOfIdleConnectionsDuringStartUpKeepsNoWorkerOut) {
  Fifo connect_gate(dir_ + "/connect_gate");
  ControllerOptions options = Options(4, {"ok", "3"});
  options.worker_env["FAKE_CONNECT_GATE_FIFO"] = connect_gate.path();
  options.max_start_failures = 0;
  auto controller = Make(std::move(options));
  ASSERT_TRUE(controller->Start().ok());
  {
    IdleFlood flood(controller->port(), 150);
    // The controller holds at most 2 x 4 + 64 unproven connections: the flood is over its cap.
    ASSERT_TRUE(flood.WaitForClosed(150 - 72)) << "the controller did not close the surplus";
    connect_gate.Open(4);
    ASSERT_TRUE(controller->Wait(kNoHang)) << "the run did not end";
  }
  const Outcome& out = controller->outcome();
  EXPECT_EQ(out.state, State::kSucceeded);
  EXPECT_FALSE(out.failure.has_value()) << out.failure->message;
  EXPECT_EQ(out.attempts, 1);
  EXPECT_EQ(out.rounds, 3u);
}

TEST_F(ControllerTest, AHelloForARankAlreadyConnectedIsRefusedAtOnce) {
  // Each worker, once registered, connects again as itself, and exits 2 unless that is refused
  // with the reason "already connected" (a kRefused frame answers the hello; no challenge).
  auto controller = Make(Options(2, {"duplicate", "2"}));
  ASSERT_NO_FATAL_FAILURE(StartAndWait(*controller));
  const Outcome& out = controller->outcome();
  EXPECT_EQ(out.state, State::kSucceeded);
  EXPECT_FALSE(out.failure.has_value()) << out.failure->message << "\n"
                                        << RunFile("logs/rank-0.log") << RunFile("logs/rank-1.log");
  EXPECT_EQ(out.rounds, 2u);
}

TEST_F(ControllerTest, SilentAndSlowPeersDelayNoRankAndAreDroppedAtTheHandshakeTimeout) {
  FakeClock clock;
  Fifo events(dir_ + "/events");
  Fifo connect_gate(dir_ + "/connect_gate");
  Fifo gate(dir_ + "/gate");
  ControllerOptions options = Options(2, {"ok", "1"});
  options.worker_env["FAKE_EVENTS_FIFO"] = events.path();
  options.worker_env["FAKE_CONNECT_GATE_FIFO"] = connect_gate.path();
  options.worker_env["FAKE_GATE_FIFO"] = gate.path();
  options.handshake_timeout = std::chrono::seconds(10);
  auto controller = Make(std::move(options), clock);
  ASSERT_TRUE(controller->Start().ok());
  const int port = controller->port();

  RawPeer silent(port);
  RawPeer slow(port);  // a slowloris: a hello one byte at a time, then nothing
  slow.Send(Frame(wire::MessageType::kHello, std::string(wire::kHelloSize, 'J')).substr(0, 3));
  SyncWithEventLoop(port);
  // Both ranks register and start while those two hold their connections; no time passes.
  connect_gate.Open(2);
  ASSERT_TRUE(events.WaitFor('S', 2)) << "the ranks did not start beside the idle peers";

  clock.Advance(std::chrono::seconds(11));
  SyncWithEventLoop(port);  // a loop step after the clock moved
  EXPECT_TRUE(silent.ClosedByController());
  EXPECT_TRUE(slow.ClosedByController());

  gate.Open(2);
  ASSERT_TRUE(controller->Wait(kNoHang));
  const Outcome& out = controller->outcome();
  EXPECT_EQ(out.state, State::kSucceeded);
  EXPECT_FALSE(out.failure.has_value()) << out.failure->message;
  EXPECT_EQ(out.rounds, 1u);
}

// A worker that ends before it has connected (one that could not get through to the controller,
// e.g.) failed to start: it counts against max_start_failures, not max_failures, and its host is
// the planned one, not "?".
TEST_F(ControllerTest, ARankThatEndsBeforeRegisteringIsAStartUpFailure) {
  ControllerOptions options = Options(2, {"earlyexit"});
  options.worker_env["FAKE_FAIL_RANK"] = "1";
  options.max_failures = 0;
  options.max_start_failures = 1;
  const std::string planned_host = options.plan.workers[1].host;
  auto controller = Make(std::move(options));
  ASSERT_NO_FATAL_FAILURE(StartAndWait(*controller));

  const Outcome& out = controller->outcome();
  EXPECT_EQ(out.state, State::kFailed);
  EXPECT_EQ(out.attempts, 2) << "a start-up failure was counted against max_failures";
  ASSERT_EQ(out.failures.size(), 2u);
  for (const RankFailure& f : out.failures) {
    EXPECT_EQ(f.rank, 1);
    EXPECT_EQ(f.cause, FailureCause::kStartUp) << f.message;
    EXPECT_FALSE(planned_host.empty());
    EXPECT_EQ(f.host, planned_host);
  }
}

}  // namespace
}  // namespace jaxtrain::controller
