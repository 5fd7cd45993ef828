// scale_controller: the C++ controller alone, with thousands of fake workers.
//
//   scale_controller --ranks N [--per-process 256] [--rate 100000] [--seconds 5] [--fake PATH]
//
// Runs one Controller (src/controller/controller.h) in this process, as the Python driver hosts
// it, with a launcher that starts ceil(N / per-process) fake_worker_pool processes
// (src/worker/testing/fake_worker_pool.cc), each running per-process ranks over real
// WorkerClient connections. The ranks connect, authenticate, register and wait for the start;
// then every rank reports at rate / N rounds per second for `seconds`, so the controller is
// offered `rate` reports per second in all, and the run ends when every rank is done.
//
// Prints one JSON line:
//   rendezvous_s       Start() to the last rank holding its start message (spawn, connect,
//                      handshake, register, start: what the controller's side of a rendezvous
//                      costs with N ranks)
//   reports_per_s      reports the controller processed per second: N * rounds over the time from
//                      the first report sent to the last round recorded in result.jsonl
//   offered_per_s      reports sent per second over the time the fake workers took to send them
//   report_cpu_cores   CPU seconds of this process (the controller's loop; the main thread only
//                      samples) over that window, per second of it
//   cpu_us_per_report  the same CPU divided by the reports
//   rendezvous_cpu_s   CPU seconds of this process during the rendezvous
//   rss_before_mb, peak_rss_mb  VmRSS before Start(), VmHWM at the end
// Exit codes: 0 measured; 1 the run failed; 2 misuse.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "controller/controller.h"
#include "launch/local_launcher.h"

namespace jaxtrain {
namespace {

double UnixNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// A line of /proc/self/status, in MB ("VmRSS", "VmHWM").
double StatusMb(const std::string& field) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024;
  }
  return 0;
}

// Starts the controller's one-rank specs as fake_worker_pool processes of `per_process` ranks.
class PoolLauncher : public launch::Launcher {
 public:
  PoolLauncher(int per_process, std::string times_file)
      : per_process_(per_process), times_file_(std::move(times_file)) {}

  StatusOr<std::vector<launch::LaunchedProcess>> Launch(
      const std::vector<launch::ProcessSpec>& specs) override {
    std::vector<launch::ProcessSpec> pools;
    for (size_t first = 0; first < specs.size(); first += static_cast<size_t>(per_process_)) {
      const size_t count = std::min(specs.size() - first, static_cast<size_t>(per_process_));
      launch::ProcessSpec pool = specs[first];
      pool.ranks.clear();
      for (size_t i = first; i < first + count; ++i) pool.ranks.push_back(specs[i].ranks.front());
      pool.env["FAKE_FIRST_RANK"] = std::to_string(first);
      pool.env["FAKE_RANK_COUNT"] = std::to_string(count);
      pool.env["FAKE_TIMES_FILE"] = times_file_;
      pools.push_back(std::move(pool));
    }
    return local_.Launch(pools);
  }
  void SignalGroup(int signal) override { local_.SignalGroup(signal); }

 private:
  int per_process_;
  std::string times_file_;
  launch::LocalLauncher local_;
};

struct Sample {
  double time;
  double cpu;
};

// CPU seconds spent between two times, from samples taken every few ms (nearest sample each).
double CpuBetween(const std::vector<Sample>& samples, double from, double to) {
  auto at = [&](double t) {
    auto it = std::lower_bound(samples.begin(), samples.end(), t,
                               [](const Sample& s, double v) { return s.time < v; });
    return it == samples.end() ? samples.back().cpu : it->cpu;
  };
  return at(to) - at(from);
}

int Misuse(const std::string& why) {
  std::fprintf(stderr, "scale_controller: %s\n", why.c_str());
  return 2;
}

int Run(int ranks, int per_process, double rate, double seconds, const std::string& fake) {
  // Every rank holds a socket and a log file in the controller's process.
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  files.rlim_cur = files.rlim_max;
  setrlimit(RLIMIT_NOFILE, &files);

  std::string dir = (std::filesystem::temp_directory_path() / "scale_controller.XXXXXX").string();
  if (mkdtemp(dir.data()) == nullptr) return Misuse("cannot create a temporary directory");
  const double per_rank = rate / ranks;
  const int rounds = std::max(1, static_cast<int>(std::lround(seconds * per_rank)));

  controller::ControllerOptions options;
  options.run_dir = dir + "/run";
  options.experiment_name = "scale";
  options.plan.platform = "cpu";
  options.plan.accelerator = "cpu";
  for (int r = 0; r < ranks; ++r) options.plan.workers.push_back({.rank = r, .host = "localhost"});
  options.worker_argv = {fake, std::to_string(rounds), std::to_string(per_rank)};
  options.console_fd = -1;
  options.start_timeout = std::chrono::seconds(120);
  options.terminate_grace = std::chrono::seconds(1);

  const std::string times_file = dir + "/times.jsonl";
  const double rss_before = StatusMb("VmRSS");
  controller::Controller controller(std::move(options),
                                    std::make_unique<PoolLauncher>(per_process, times_file));
  std::vector<Sample> samples;
  samples.reserve(100000);
  const double t_start = UnixNow();
  samples.push_back({t_start, CpuSeconds()});
  Status s = controller.Start();
  if (!s.ok()) return Misuse("Start(): " + s.ToString());
  while (!controller.Wait(std::chrono::milliseconds(5)))
    samples.push_back({UnixNow(), CpuSeconds()});
  samples.push_back({UnixNow(), CpuSeconds()});
  const auto& outcome = controller.outcome();
  if (outcome.state != controller::Outcome::State::kSucceeded) {
    std::fprintf(stderr, "scale_controller: the run did not succeed: %s %s (logs in %s)\n",
                 std::string(controller::OutcomeStateName(outcome.state)).c_str(),
                 outcome.failure ? outcome.failure->message.c_str() : "", dir.c_str());
    return 1;
  }

  double started = 0, first_report = 1e300, last_sent = 0;
  int processes = 0;
  std::ifstream times(times_file);
  for (std::string line; std::getline(times, line); ++processes) {
    auto j = nlohmann::json::parse(line);
    started = std::max(started, j["started"].get<double>());
    first_report = std::min(first_report, j["first_report"].get<double>());
    last_sent = std::max(last_sent, j["last_report"].get<double>());
  }
  double last_recorded = 0;
  std::ifstream results(dir + "/run/result.jsonl");
  for (std::string line; std::getline(results, line);) {
    last_recorded = std::max(last_recorded, nlohmann::json::parse(line)["time"].get<double>());
  }
  const double reports = static_cast<double>(ranks) * rounds;
  const double window = last_recorded - first_report;
  const double report_cpu = CpuBetween(samples, first_report, last_recorded);
  nlohmann::json out = {
      {"ranks", ranks},
      {"processes", processes},
      {"rounds", rounds},
      {"reports", reports},
      {"rendezvous_s", started - t_start},
      {"rendezvous_cpu_s", CpuBetween(samples, t_start, started)},
      {"reports_per_s", reports / window},
      {"offered_per_s", reports / (last_sent - first_report)},
      {"report_cpu_cores", report_cpu / window},
      {"cpu_us_per_report", report_cpu / reports * 1e6},
      {"rss_before_mb", rss_before},
      {"peak_rss_mb", StatusMb("VmHWM")},
  };
  std::filesystem::remove_all(dir);
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace
}  // namespace jaxtrain

int main(int argc, char** argv) {
  int ranks = 0, per_process = 256;
  double rate = 100000, seconds = 5;
  std::string fake = FAKE_WORKER_POOL_PATH;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--ranks") {
      ranks = std::atoi(value.c_str());
    } else if (flag == "--per-process") {
      per_process = std::atoi(value.c_str());
    } else if (flag == "--rate") {
      rate = std::atof(value.c_str());
    } else if (flag == "--seconds") {
      seconds = std::atof(value.c_str());
    } else if (flag == "--fake") {
      fake = value;
    } else {
      return jaxtrain::Misuse("unknown flag " + flag);
    }
  }
  if (argc % 2 != 1 || ranks < 1 || per_process < 1 || rate <= 0 || seconds <= 0) {
    return jaxtrain::Misuse(
        "usage: scale_controller --ranks N [--per-process 256] [--rate 100000] [--seconds 5] "
        "[--fake PATH]");
  }
  return jaxtrain::Run(ranks, per_process, rate, seconds, fake);
}
