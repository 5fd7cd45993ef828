// fake_worker_pool: many fake ranks in one process, for the controller's scale benchmark
// (bench/scale_controller.cc). Each rank is one real WorkerClient connection, without JAX or
// Python, so thousands of ranks need only a few processes. Each process plays one host, with a
// loopback address of its own; its ranks connect, authenticate and register from kConnectThreads
// threads at once, as real workers, each a process, do in parallel; their reports are then sent
// one rank after the other.
//
//   fake_worker_pool <rounds> <rounds_per_second>
//
// Every rank of the process connects, authenticates and registers (rank 0 publishes a
// coordinator, as the controller requires); then the process waits for each rank's start. It then
// sends `rounds` report rounds, one report of {"loss": x, "rank": R} per rank per round, the
// rounds paced at `rounds_per_second` (0 = as fast as it can), then done for each rank, and
// exits 0.
//
// Environment: the JAXTRAIN_* variables the controller sets, and
//   FAKE_FIRST_RANK, FAKE_RANK_COUNT  the ranks this process runs: [first, first + count)
//   FAKE_TIMES_FILE                   where the process appends one JSON line of its times
//                                     (CLOCK_REALTIME seconds): spawned, registered (every rank),
//                                     started (every rank), first_report, last_report
//   FAKE_STARTED_FIFO, FAKE_GO_FIFO   optional: once the process holds every start it writes a
//                                     byte to the first and reads the second until it ends, and
//                                     only then reports (the benchmark's start barrier)
// The process dies with its parent (PR_SET_PDEATHSIG), which is the controller's process.
// Exit codes: 0 done; 2 misuse or an unexpected error.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "wire/handshake.h"
#include "worker/worker_client.h"

namespace jaxtrain::worker {
namespace {

constexpr int kExitMisuse = 2;
constexpr int kConnectThreads = 16;

int Misuse(const std::string& why) {
  std::fprintf(stderr, "fake_worker_pool: %s\n", why.c_str());
  return kExitMisuse;
}

double UnixNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

int Run(int rounds, double rounds_per_second) {
  const double spawned = UnixNow();
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  const char* address = std::getenv("JAXTRAIN_CONTROLLER_ADDR");
  auto key = TakeRunSecret();
  const char* times_file = std::getenv("FAKE_TIMES_FILE");
  if (address == nullptr || !key.ok() || times_file == nullptr) {
    return Misuse("JAXTRAIN_CONTROLLER_ADDR, the run secret and FAKE_TIMES_FILE must be set");
  }
  const int first = EnvInt("FAKE_FIRST_RANK", 0);
  const int count = EnvInt("FAKE_RANK_COUNT", 1);
  WorkerClientOptions options;
  auto controller = wire::ParseHostPort(address);
  if (!controller.ok()) return Misuse("bad JAXTRAIN_CONTROLLER_ADDR");
  options.controller = *controller;
  options.secret = *key;
  options.attempt = static_cast<uint32_t>(EnvInt("JAXTRAIN_ATTEMPT", 0));
  // Each process is a host of its own, with an address of its own on loopback (127.1.x.y), so
  // that its ranks' connections need no ephemeral port that another process's use: from one
  // address, the kernel's search for a free port among 16k connections to the same port took
  // most of the benchmark's CPU (perf: __inet_check_established).
  const int host_index = count > 0 ? first / count : 0;
  options.source_address =
      "127.1." + std::to_string(host_index / 200) + "." + std::to_string(host_index % 200 + 2);

  // Opened before anything else, while the benchmark holds it open for writing: a read then
  // waits for the benchmark's go (the end of the FIFO) however late this process gets there.
  int go = -1;
  if (const char* path = std::getenv("FAKE_GO_FIFO")) {
    go = open(path, O_RDONLY | O_CLOEXEC);
    if (go < 0 || std::getenv("FAKE_STARTED_FIFO") == nullptr) {
      return Misuse("FAKE_GO_FIFO cannot be opened, or FAKE_STARTED_FIFO is not set");
    }
  }
  char host[256] = "";
  gethostname(host, sizeof(host) - 1);
  std::vector<std::unique_ptr<WorkerClient>> clients(static_cast<size_t>(count));
  std::vector<Status> errors(kConnectThreads);
  std::vector<std::thread> connecting;
  for (int t = 0; t < kConnectThreads; ++t) {
    connecting.emplace_back([&, t, options]() mutable {
      for (int i = t; i < count; i += kConnectThreads) {
        const int rank = first + i;
        options.rank = static_cast<uint32_t>(rank);
        nlohmann::json registration = {{"host", host}, {"pid", getpid()}};
        if (rank == 0) registration["coordinator"] = "127.0.0.1:1";
        options.registration = registration.dump();
        auto client = WorkerClient::Connect(options);
        if (!client.ok()) {
          errors[static_cast<size_t>(t)] = client.status();
          return;
        }
        clients[static_cast<size_t>(i)] = std::move(*client);
      }
    });
  }
  for (auto& thread : connecting) thread.join();
  for (const Status& s : errors) {
    if (!s.ok()) return Misuse(s.ToString());
  }
  const double registered = UnixNow();
  for (auto& client : clients) {
    auto start = client->WaitStart();
    if (!start.ok()) return Misuse(start.status().ToString());
  }
  const double started = UnixNow();
  if (go >= 0) {
    int fifo = open(std::getenv("FAKE_STARTED_FIFO"), O_WRONLY | O_CLOEXEC);
    if (fifo < 0 || write(fifo, "s", 1) != 1) return Misuse("cannot write FAKE_STARTED_FIFO");
    close(fifo);
    char byte;
    while (read(go, &byte, 1) > 0) {
    }
    close(go);
  }

  using Clock = std::chrono::steady_clock;
  const auto begin = Clock::now();
  double first_report = 0;
  for (int round = 1; round <= rounds; ++round) {
    if (rounds_per_second > 0) {
      std::this_thread::sleep_until(
          begin + std::chrono::duration_cast<Clock::duration>(
                      std::chrono::duration<double>((round - 1) / rounds_per_second)));
    }
    if (round == 1) first_report = UnixNow();
    for (int i = 0; i < count; ++i) {
      nlohmann::json metrics = {{"loss", 1.0 / round}, {"rank", first + i}};
      Status s =
          clients[static_cast<size_t>(i)]->Report(static_cast<uint64_t>(round), metrics.dump());
      if (!s.ok()) return Misuse(s.ToString());
    }
  }
  const double last_report = UnixNow();
  for (auto& client : clients) {
    Status s = client->SendDone("{}");
    if (!s.ok()) return Misuse(s.ToString());
  }

  nlohmann::json times = {{"first_rank", first},       {"count", count},
                          {"spawned", spawned},        {"registered", registered},
                          {"started", started},        {"first_report", first_report},
                          {"last_report", last_report}};
  const std::string line = times.dump() + "\n";
  int fd = open(times_file, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0 || write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
    return Misuse(std::string("cannot append to ") + times_file);
  }
  close(fd);
  return 0;
}

}  // namespace
}  // namespace jaxtrain::worker

int main(int argc, char** argv) {
  if (argc != 3) return jaxtrain::worker::Misuse("usage: fake_worker_pool <rounds> <rounds/s>");
  const int rounds = std::atoi(argv[1]);
  const double rate = std::atof(argv[2]);
  if (rounds < 0 || rate < 0) return jaxtrain::worker::Misuse("rounds and rounds/s must be >= 0");
  return jaxtrain::worker::Run(rounds, rate);
}
