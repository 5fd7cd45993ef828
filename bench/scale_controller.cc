// scale_controller: the C++ controller alone, with thousands of fake workers, from 1k to 16k ranks.
//
//   scale_controller [--ranks 1024,2048,4096,8192,16384] [--per-process 256]
//                    [--reports 1000000 | --rate R --seconds S] [--progress-timeout 60]
//                    [--fake PATH]
//
// For each size N it runs, each in a fresh process of its own (so each peak RSS is its own):
//
// * the controller: one Controller (src/controller/controller.h), as the Python driver hosts it,
//   with a launcher that starts ceil(N / per-process) fake_worker_pool processes
//   (src/worker/testing/fake_worker_pool.cc), each running per-process ranks over real
//   WorkerClient connections. The ranks connect, authenticate, register and wait for the start;
//   then every rank sends reports / N report rounds as fast as it can (or, with --rate, at
//   rate / N rounds per second for `seconds`), and the run ends when every rank is done. Unpaced,
//   the controller is kept busy, so its CPU per report is what a loaded controller pays, not the
//   cost of waking up for every frame. The progress watchdog is on (--progress-timeout,
//   0 = off), as a run at scale would have it.
// * the floor: the same number of report frames, of the same size, sent the same way (N loopback
//   TCP connections, one report per connection per round, sent alike by as many processes) and
//   received by a bare epoll loop that only splits them into frames: what the
//   kernel and one event loop cost per report, whatever the controller does with it.
//
// Then it prints one table: each figure at N beside its baseline from the same run, as a ratio:
//   rendezvous       Start() to the last rank holding its start message; baseline: the 1k figure
//                    scaled linearly to N (ratio 1: it grows no faster than the ranks)
//   CPU per report   the controller process's CPU over the report window per report; baseline:
//                    the floor's CPU per frame at the same N (ratio: what the controller adds)
//                    and the controller's own figure at 1k (ratio 1: O(1) per report)
//   reports/s/core   1e6 / CPU per report: what one controller core sustains (target 300,000)
//   RSS              peak RSS (VmHWM) less RSS before Start(), per rank; baseline: the 1k
//                    figure (ratio 1: O(1) memory per rank)
// and then each figure's growth from the smallest size (rendezvous and RSS should grow as the
// ranks do, the rate per core not fall), and the largest size's figures as a ratio to the targets
// (rendezvous < 1 s, >= 300,000 reports/s per core, RSS < 64 MB).
//
// Descriptors: the controller holds one connection per rank, the fake workers' pidfds and output
// pipes (one each per process of per-process ranks), and the logs of the ranks that print (the
// fake ranks print nothing); the fake workers, the floor's senders, are other processes with their
// own limits. 16,384 ranks thus need about 16,700 descriptors in the controller's process.
//
// With a single --ranks N it runs the controller once in this process and prints its one JSON
// line (the figures below), as bench/compare_ray.py reads it; --floor N prints the floor's.
//   rendezvous_s       Start() to the last rank holding its start message
//   reports_per_s      reports the controller processed per second: N * rounds over the time from
//                      the first report sent to the last round recorded in result.jsonl
//   offered_per_s      reports sent per second over the time the fake workers took to send them
//   report_cpu_cores   CPU seconds of this process (the controller's loop; the main thread only
//                      samples) over that window, per second of it
//   cpu_us_per_report  the same CPU divided by the reports
//   last_spawned_s     Start() to the last fake process's first instruction (the launch's part)
//   last_registered_s  Start() to the last process having connected and registered all its ranks
//   rendezvous_cpu_s   CPU seconds of this process during the rendezvous
//   rss_before_mb, peak_rss_mb  VmRSS before Start(), VmHWM at the end
// Exit codes: 0 measured; 1 a run failed; 2 misuse.
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
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
#include <thread>
#include <vector>

#include "base/open_files.h"
#include "controller/controller.h"
#include "launch/local_launcher.h"
#include "wire/frame.h"

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
  PoolLauncher(int per_process, std::string times_file, std::string barrier_dir)
      : per_process_(per_process),
        times_file_(std::move(times_file)),
        barrier_dir_(std::move(barrier_dir)) {}

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
      pool.env["FAKE_STARTED_FIFO"] = barrier_dir_ + "/started";
      pool.env["FAKE_GO_FIFO"] = barrier_dir_ + "/go";
      pools.push_back(std::move(pool));
    }
    return local_.Launch(pools);
  }
  Status SignalGroup(int signal) override { return local_.SignalGroup(signal); }

 private:
  int per_process_;
  std::string times_file_;
  std::string barrier_dir_;
  launch::LocalLauncher local_;
};

// The fake processes start reporting together, once every one of them holds its ranks' starts:
// reports of the first processes must not take the CPU from those still starting (on a cluster
// they run on other hosts), or the rendezvous would measure this machine's two cores. Each process
// writes a byte to the FIFO `started` when it holds its starts and then reads the FIFO `go` until
// it ends, which it does once Release() closes the only writer.
class StartBarrier {
 public:
  // Errors: kInternal when the FIFOs cannot be made in `dir`.
  static StatusOr<std::unique_ptr<StartBarrier>> Create(const std::string& dir, int processes) {
    for (const char* name : {"/started", "/go"}) {
      if (mkfifo((dir + name).c_str(), 0600) != 0) {
        return ErrnoError("cannot make the FIFO " + dir + name, errno);
      }
    }
    // Read-write opens never block; holding `go` open for writing keeps its readers waiting.
    int started = open((dir + "/started").c_str(), O_RDWR | O_CLOEXEC);
    int go = open((dir + "/go").c_str(), O_RDWR | O_CLOEXEC);
    if (started < 0 || go < 0) return ErrnoError("cannot open the FIFOs in " + dir, errno);
    return std::unique_ptr<StartBarrier>(new StartBarrier(started, go, processes));
  }
  ~StartBarrier() {
    stop_ = true;
    thread_.join();
    close(started_);
    if (go_ >= 0) close(go_);
  }

 private:
  StartBarrier(int started, int go, int processes) : started_(started), go_(go) {
    thread_ = std::thread([this, processes] {
      for (int seen = 0; seen < processes && !stop_;) {
        pollfd p{started_, POLLIN, 0};
        char bytes[256];
        // The timeout only lets the destructor end a run whose processes never all started.
        if (poll(&p, 1, 100) == 1) seen += std::max<int>(0, read(started_, bytes, sizeof(bytes)));
      }
      close(go_);  // every process reads the end of `go` and reports
      go_ = -1;
    });
  }

  const int started_;
  int go_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
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

struct Load {
  int ranks;
  int per_process;
  double rate;     // reports per second offered, all ranks together; 0: as fast as they can
  double seconds;  // of reports, when paced
  double reports;  // in all, when not paced
  int rounds() const {
    const double total = rate > 0 ? rate * seconds : reports;
    return std::max(1, static_cast<int>(std::lround(total / ranks)));
  }
  double rounds_per_second() const { return rate / ranks; }
  int processes() const { return (ranks + per_process - 1) / per_process; }
};

int Run(const Load& load, double progress_timeout_s, const std::string& fake) {
  std::string dir = (std::filesystem::temp_directory_path() / "scale_controller.XXXXXX").string();
  if (mkdtemp(dir.data()) == nullptr) return Misuse("cannot create a temporary directory");
  const int ranks = load.ranks;
  const int rounds = load.rounds();

  controller::ControllerOptions options;
  options.run_dir = dir + "/run";
  options.experiment_name = "scale";
  options.plan.platform = "cpu";
  options.plan.accelerator = "cpu";
  for (int r = 0; r < ranks; ++r) options.plan.workers.push_back({.rank = r, .host = "localhost"});
  options.worker_argv = {fake, std::to_string(rounds), std::to_string(load.rounds_per_second())};
  options.console_fd = -1;
  options.start_timeout = std::chrono::seconds(120);
  options.terminate_grace = std::chrono::seconds(1);
  options.progress_timeout =
      std::chrono::duration_cast<Duration>(std::chrono::duration<double>(progress_timeout_s));

  const std::string times_file = dir + "/times.jsonl";
  auto barrier = StartBarrier::Create(dir, load.processes());
  if (!barrier.ok()) return Misuse(barrier.status().ToString());
  const double rss_before = StatusMb("VmRSS");
  controller::Controller controller(
      std::move(options), std::make_unique<PoolLauncher>(load.per_process, times_file, dir));
  std::vector<Sample> samples;
  samples.reserve(100000);
  const double t_start = UnixNow();
  samples.push_back({t_start, CpuSeconds()});
  // Start() raises RLIMIT_NOFILE as the ranks need, or says which limit stands in the way.
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

  double spawned = 0, registered = 0, started = 0, first_report = 1e300, last_sent = 0;
  int processes = 0;
  std::ifstream times(times_file);
  for (std::string line; std::getline(times, line); ++processes) {
    auto j = nlohmann::json::parse(line);
    spawned = std::max(spawned, j["spawned"].get<double>());
    registered = std::max(registered, j["registered"].get<double>());
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
      {"last_spawned_s", spawned - t_start},
      {"last_registered_s", registered - t_start},
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

// The floor: N loopback TCP connections; child processes (per-process connections each, which
// they open themselves) send the same report frames the fake workers send (one per connection per
// round, rounds paced alike) and this process receives them in a bare epoll loop that splits the
// bytes into frames and counts them.
int RunFloor(const Load& load) {
  const int n = load.ranks;
  const int rounds = load.rounds();
  // This process holds the receiving ends only; each sender process connects its own ranks, so
  // neither needs more descriptors than it has connections (the controller's case too).
  Status limit = RaiseOpenFileLimit(static_cast<uint64_t>(n) + 64, 0);
  if (!limit.ok()) return Misuse("the floor: " + limit.ToString());
  int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{.sin_family = AF_INET, .sin_port = 0, .sin_addr = {htonl(INADDR_LOOPBACK)}};
  socklen_t len = sizeof(addr);
  if (bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listener, 4096) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return Misuse("the floor: cannot listen on 127.0.0.1");
  }
  // The senders start sending once this process closes its end of `go` (every connection then
  // has been accepted).
  int go[2];
  if (pipe2(go, O_CLOEXEC) != 0) return Misuse("the floor: cannot create a pipe");
  std::vector<pid_t> children;
  for (int proc = 0; proc < load.processes(); ++proc) {
    const pid_t child = fork();
    if (child < 0) return Misuse("the floor: cannot fork");
    if (child > 0) {
      children.push_back(child);
      continue;
    }
    close(listener);
    close(go[1]);
    const int first = proc * load.per_process;
    const int last = std::min(n, first + load.per_process);
    std::vector<int> senders;
    for (int i = first; i < last; ++i) {
      int c = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (c < 0 || connect(c, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) _exit(2);
      int one = 1;
      setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      senders.push_back(c);
    }
    char byte;
    while (read(go[0], &byte, 1) < 0 && errno == EINTR) {
    }
    using Clock = std::chrono::steady_clock;
    const auto begin = Clock::now();
    for (int round = 1; round <= rounds; ++round) {
      if (load.rate > 0) {
        std::this_thread::sleep_until(
            begin + std::chrono::duration_cast<Clock::duration>(
                        std::chrono::duration<double>((round - 1) / load.rounds_per_second())));
      }
      for (int i = first; i < last; ++i) {
        nlohmann::json metrics = {{"loss", 1.0 / round}, {"rank", i}};
        const std::string frame = *wire::EncodeFrame(
            wire::MessageType::kReport,
            wire::EncodeReportBody(static_cast<uint64_t>(round), metrics.dump()));
        if (send(senders[static_cast<size_t>(i - first)], frame.data(), frame.size(),
                 MSG_NOSIGNAL) != static_cast<ssize_t>(frame.size())) {
          _exit(2);
        }
      }
    }
    _exit(0);
  }
  close(go[0]);
  std::vector<int> receivers;
  for (int i = 0; i < n; ++i) {
    int a = accept4(listener, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (a < 0) return Misuse("the floor: cannot accept");
    receivers.push_back(a);
  }
  close(listener);
  close(go[1]);
  int ep = epoll_create1(EPOLL_CLOEXEC);
  for (int i = 0; i < n; ++i) {
    epoll_event ev{.events = EPOLLIN, .data = {.u64 = static_cast<uint64_t>(i)}};
    epoll_ctl(ep, EPOLL_CTL_ADD, receivers[static_cast<size_t>(i)], &ev);
  }
  // Per connection: the bytes of the frame being received, its header first.
  struct Partial {
    char head[wire::kFrameHeaderSize];
    size_t have = 0;  // header bytes received
    size_t body = 0;  // body bytes still to come
  };
  std::vector<Partial> partial(static_cast<size_t>(n));
  const uint64_t expected = static_cast<uint64_t>(n) * static_cast<uint64_t>(rounds);
  uint64_t frames = 0;
  double first = 0, cpu_first = 0;
  std::vector<char> buf(64 << 10);
  epoll_event events[1024];
  while (frames < expected) {
    int ready = epoll_wait(ep, events, 1024, 10'000);
    if (ready <= 0) return Misuse("the floor: the sender stopped");
    if (first == 0) {
      first = UnixNow();
      cpu_first = CpuSeconds();
    }
    for (int e = 0; e < ready; ++e) {
      Partial& p = partial[events[e].data.u64];
      const int fd = receivers[events[e].data.u64];
      for (;;) {
        ssize_t got = recv(fd, buf.data(), buf.size(), 0);
        if (got <= 0) break;
        for (size_t at = 0; at < static_cast<size_t>(got);) {
          if (p.body > 0) {
            const size_t take = std::min(p.body, static_cast<size_t>(got) - at);
            p.body -= take;
            at += take;
            if (p.body == 0) ++frames;
            continue;
          }
          p.head[p.have++] = buf[at++];
          if (p.have == wire::kFrameHeaderSize) {
            const auto* h = reinterpret_cast<const unsigned char*>(p.head);
            p.body = ((size_t{h[0]} << 24) | (size_t{h[1]} << 16) | (size_t{h[2]} << 8) | h[3]) - 1;
            p.have = 0;
            if (p.body == 0) ++frames;
          }
        }
        if (static_cast<size_t>(got) < buf.size()) break;
      }
    }
  }
  const double window = UnixNow() - first;
  const double cpu = CpuSeconds() - cpu_first;
  for (pid_t child : children) waitpid(child, nullptr, 0);
  nlohmann::json out = {{"ranks", n},
                        {"reports", expected},
                        {"floor_reports_per_s", static_cast<double>(expected) / window},
                        {"floor_cpu_us_per_report", cpu / static_cast<double>(expected) * 1e6}};
  std::cout << out.dump() << std::endl;
  return 0;
}

// Runs this program again with `args`, and returns the JSON object its last line of output is.
StatusOr<nlohmann::json> RunChild(const std::vector<std::string>& args) {
  // popen() runs a shell, whose /proc/self/exe is the shell: name this program's file instead.
  std::string command = std::filesystem::read_symlink("/proc/self/exe").string();
  for (const auto& a : args) command += " '" + a + "'";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return InternalError("cannot run " + command);
  std::string output;
  char buf[4096];
  while (size_t got = fread(buf, 1, sizeof(buf), pipe)) output.append(buf, got);
  const int status = pclose(pipe);
  if (status != 0)
    return InternalError(command + " failed (status " + std::to_string(status) + ")");
  std::string last = output.substr(0, output.find_last_not_of('\n') + 1);
  last = last.substr(last.find_last_of('\n') + 1);
  auto j = nlohmann::json::parse(last, nullptr, false);
  if (!j.is_object()) return InternalError(command + " printed no figures: " + output);
  return j;
}

int Sweep(const std::vector<int>& sizes, const Load& base, double progress_timeout_s,
          const std::string& fake) {
  struct Row {
    nlohmann::json run, floor;
  };
  std::vector<Row> rows;
  auto common = [&]() {
    return std::vector<std::string>{"--per-process", std::to_string(base.per_process),
                                    "--rate",        std::to_string(base.rate),
                                    "--seconds",     std::to_string(base.seconds),
                                    "--reports",     std::to_string(base.reports)};
  };
  for (int n : sizes) {
    std::vector<std::string> args = common();
    args.insert(args.begin(), {"--ranks", std::to_string(n)});
    args.insert(args.end(),
                {"--progress-timeout", std::to_string(progress_timeout_s), "--fake", fake});
    auto run = RunChild(args);
    if (!run.ok()) return std::fprintf(stderr, "%s\n", run.status().ToString().c_str()), 1;
    std::cout << run->dump() << std::endl;
    std::vector<std::string> floor_args = common();
    floor_args.insert(floor_args.begin(), {"--floor", std::to_string(n)});
    auto floor = RunChild(floor_args);
    if (!floor.ok()) return std::fprintf(stderr, "%s\n", floor.status().ToString().c_str()), 1;
    std::cout << floor->dump() << std::endl;
    rows.push_back({*run, *floor});
  }
  const nlohmann::json& first = rows.front().run;
  const double n0 = first["ranks"].get<double>();
  auto rss_per_rank_kb = [](const nlohmann::json& r) {
    return (r["peak_rss_mb"].get<double>() - r["rss_before_mb"].get<double>()) * 1024 /
           r["ranks"].get<double>();
  };
  std::printf(
      "\nbaselines: rendezvous, the %.0f-rank figure scaled linearly; CPU per report, the "
      "bare epoll loop at the same N (floor) and the %.0f-rank figure; RSS per rank, the "
      "%.0f-rank figure. Ratio 1.00 = grows no faster than the ranks / the floor.\n",
      n0, n0, n0);
  std::printf("%6s %5s | %8s %8s %6s | %7s %7s %6s %6s | %9s %9s | %7s %7s %6s | %9s\n", "ranks",
              "procs", "rdv s", "linear", "x", "us/rep", "floor", "x flr", "x 1k", "rep/s/core",
              "offered/s", "RSS MB", "KB/rank", "x 1k", "processed/s");
  for (const Row& row : rows) {
    const nlohmann::json& r = row.run;
    const double n = r["ranks"].get<double>();
    const double linear = first["rendezvous_s"].get<double>() * n / n0;
    const double us = r["cpu_us_per_report"].get<double>();
    const double floor_us = row.floor["floor_cpu_us_per_report"].get<double>();
    std::printf(
        "%6.0f %5d | %8.3f %8.3f %6.2f | %7.2f %7.2f %6.2f %6.2f | %9.0f %9.0f | %7.1f %7.2f %6.2f "
        "| %9.0f\n",
        n, r["processes"].get<int>(), r["rendezvous_s"].get<double>(), linear,
        r["rendezvous_s"].get<double>() / linear, us, floor_us, us / floor_us,
        us / first["cpu_us_per_report"].get<double>(), 1e6 / us, r["offered_per_s"].get<double>(),
        r["peak_rss_mb"].get<double>(), rss_per_rank_kb(r),
        rss_per_rank_kb(r) / rss_per_rank_kb(first), r["reports_per_s"].get<double>());
  }
  const nlohmann::json& last = rows.back().run;
  const double last_us = last["cpu_us_per_report"].get<double>();
  // Growth from the smallest size to each: a figure that grows with the ranks (rendezvous, RSS)
  // is O(1) per rank when its growth equals the ranks'; the rate per core should not fall.
  std::printf("\ngrowth from %.0f ranks: %6s | %9s %6s | %11s %6s | %8s %8s %6s\n", n0, "ranks",
              "rdv s", "x", "rep/s/core", "x", "RSS MB", "KB/rank", "x");
  for (const Row& row : rows) {
    const nlohmann::json& r = row.run;
    const double n = r["ranks"].get<double>();
    const double rate = 1e6 / r["cpu_us_per_report"].get<double>();
    std::printf("%*s x%-5.0f | %9.3f %6.2f | %11.0f %6.2f | %8.1f %8.2f %6.2f\n", 18, "", n / n0,
                r["rendezvous_s"].get<double>(),
                r["rendezvous_s"].get<double>() / first["rendezvous_s"].get<double>(), rate,
                rate / (1e6 / first["cpu_us_per_report"].get<double>()),
                r["peak_rss_mb"].get<double>(), rss_per_rank_kb(r),
                rss_per_rank_kb(r) / rss_per_rank_kb(first));
  }
  std::printf(
      "ratio to target at %.0f ranks: rendezvous %.2f of 1 s; rate %.2f x 300,000/s per core; "
      "RSS %.2f of 64 MB\n",
      last["ranks"].get<double>(), last["rendezvous_s"].get<double>() / 1.0, 1e6 / last_us / 300000,
      last["peak_rss_mb"].get<double>() / 64);
  auto verdict = [](bool met) { return met ? "met" : "NOT met"; };
  std::printf(
      "targets at %.0f ranks: rendezvous < 1 s: %s (%.3f s); >= 300,000 reports/s per "
      "controller core: %s (%.0f); controller RSS < 64 MB: %s (%.1f MB)\n",
      last["ranks"].get<double>(), verdict(last["rendezvous_s"].get<double>() < 1),
      last["rendezvous_s"].get<double>(), verdict(1e6 / last_us >= 300000), 1e6 / last_us,
      verdict(last["peak_rss_mb"].get<double>() < 64), last["peak_rss_mb"].get<double>());
  return 0;
}

std::vector<int> ParseSizes(const std::string& text) {
  std::vector<int> sizes;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) sizes.push_back(std::atoi(item.c_str()));
  return sizes;
}

}  // namespace
}  // namespace jaxtrain

int main(int argc, char** argv) {
  std::vector<int> sizes = {1024, 2048, 4096, 8192, 16384};
  int floor = 0;
  jaxtrain::Load load{
      .ranks = 0, .per_process = 256, .rate = 0, .seconds = 5, .reports = 1'000'000};
  double progress_timeout_s = 60;
  std::string fake = FAKE_WORKER_POOL_PATH;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--ranks") {
      sizes = jaxtrain::ParseSizes(value);
    } else if (flag == "--floor") {
      floor = std::atoi(value.c_str());
    } else if (flag == "--per-process") {
      load.per_process = std::atoi(value.c_str());
    } else if (flag == "--rate") {
      load.rate = std::atof(value.c_str());
    } else if (flag == "--seconds") {
      load.seconds = std::atof(value.c_str());
    } else if (flag == "--reports") {
      load.reports = std::atof(value.c_str());
    } else if (flag == "--progress-timeout") {
      progress_timeout_s = std::atof(value.c_str());
    } else if (flag == "--fake") {
      fake = value;
    } else {
      return jaxtrain::Misuse("unknown flag " + flag);
    }
  }
  const bool sizes_ok =
      !sizes.empty() && std::all_of(sizes.begin(), sizes.end(), [](int n) { return n >= 1; });
  if (argc % 2 != 1 || !sizes_ok || floor < 0 || load.per_process < 1 || load.rate < 0 ||
      load.seconds <= 0 || load.reports < 1 || progress_timeout_s < 0) {
    return jaxtrain::Misuse(
        "usage: scale_controller [--ranks 1024,2048,4096,8192,16384] [--per-process 256] "
        "[--rate 0 | --rate R --seconds S] [--reports 1000000] [--progress-timeout 60] "
        "[--fake PATH]   (--floor N: the floor alone)");
  }
  if (floor > 0) {
    load.ranks = floor;
    return jaxtrain::RunFloor(load);
  }
  if (sizes.size() == 1) {
    load.ranks = sizes.front();
    return jaxtrain::Run(load, progress_timeout_s, fake);
  }
  return jaxtrain::Sweep(sizes, load, progress_timeout_s, fake);
}
