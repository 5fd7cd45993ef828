#include "storage/run_store.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <ctime>
#include <sstream>
#include <thread>
#include <utility>

#include "base/clock.h"
#include "base/mutex.h"
#include "storage/files.h"
#include "storage/metrics.h"

namespace jaxtrain::storage {
namespace {

void Flatten(const nlohmann::json& j, const std::string& prefix,
             std::vector<std::pair<std::string, std::string>>* out) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    std::string key = prefix.empty() ? it.key() : prefix + "/" + it.key();
    if (it->is_object()) {
      Flatten(*it, key, out);
    } else if (it->is_string()) {
      out->emplace_back(key, it->get<std::string>());
    } else {
      out->emplace_back(key, it->dump());
    }
  }
}

std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

constexpr char kLockName[] = "LOCK";

struct flock WholeFile(short type) {
  struct flock lock {};
  lock.l_type = type;
  lock.l_whence = SEEK_SET;
  return lock;  // l_start = l_len = 0: the whole file, however long
}

std::string ReadAll(int fd) {
  std::string out;
  char buf[512];
  for (off_t at = 0;;) {
    ssize_t n = pread(fd, buf, sizeof(buf), at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || out.size() > 4096) return out;
    out.append(buf, static_cast<size_t>(n));
    at += n;
  }
}

// LOCK's contents, {"host", "pid", "since"}, as "host H, pid P, since 2026-12-03 07:30:00 UTC".
std::string DescribeHolder(const std::string& text) {
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object() || !j.contains("host") || !j["host"].is_string() || !j.contains("pid")) {
    return "";
  }
  std::string out = "host " + j["host"].get<std::string>() + ", pid " + j["pid"].dump();
  if (j.contains("since") && j["since"].is_number()) {
    std::time_t t = static_cast<std::time_t>(j["since"].get<double>());
    std::tm tm{};
    gmtime_r(&t, &tm);
    char buf[48];
    std::strftime(buf, sizeof(buf), ", since %Y-%m-%d %H:%M:%S UTC", &tm);
    out += buf;
  }
  return out;
}

constexpr char kLeaseName[] = "LEASE";

std::string ThisHost() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return host;
}

std::string ThisDriver() {
  return nlohmann::json{{"host", ThisHost()}, {"pid", getpid()}, {"since", std::time(nullptr)}}
             .dump() +
         "\n";
}

// Whether process `pid` of this host runs: it exists and is not a zombie (killed, not yet reaped).
bool ProcessExists(int64_t pid) {
  if (pid <= 0 || (kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM)) return false;
  auto stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  if (!stat.ok()) return true;
  const size_t end = stat->rfind(')');  // the state follows the command name: "pid (comm) S"
  return end == std::string::npos || end + 2 >= stat->size() || (*stat)[end + 2] != 'Z';
}

std::string LeaseText(const Lease& lease) {
  nlohmann::json j = {{"host", lease.host},
                      {"pid", lease.pid},
                      {"since", lease.since},
                      {"heartbeat", lease.heartbeat},
                      {"period_s", kLeasePeriodSeconds},
                      {"stale_after_s", kLeaseStaleAfterSeconds}};
  return j.dump() + "\n";
}

// "host H, pid P, since T, lease renewed N s ago" for a live lease read at `now`.
std::string DescribeLease(const Lease& lease, double now) {
  nlohmann::json j = {{"host", lease.host}, {"pid", lease.pid}};
  if (lease.since > 0) j["since"] = lease.since;
  return DescribeHolder(j.dump()) + ", lease renewed " +
         std::to_string(static_cast<long long>(std::max(0.0, std::round(now - lease.heartbeat)))) +
         " s ago";
}

// The live lease of `run_dir` described, or "" when there is none.
std::string LiveLease(const std::string& run_dir) {
  auto text = ReadFile(JoinPath(run_dir, kLeaseName));
  if (!text.ok()) return "";
  std::optional<Lease> lease = ParseLease(*text);
  const double now = RealClock().UnixSeconds();
  if (!lease || !LeaseIsLive(*lease, now, ThisHost(), getpid(), ProcessExists)) return "";
  return DescribeLease(*lease, now);
}

}  // namespace

std::optional<Lease> ParseLease(std::string_view text) {
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object() || !j.contains("host") || !j["host"].is_string() || !j.contains("pid") ||
      !j["pid"].is_number_integer() || !j.contains("heartbeat") || !j["heartbeat"].is_number()) {
    return std::nullopt;
  }
  Lease lease{.host = j["host"].get<std::string>(),
              .pid = j["pid"].get<int64_t>(),
              .heartbeat = j["heartbeat"].get<double>()};
  if (j.contains("since") && j["since"].is_number()) lease.since = j["since"].get<double>();
  return lease;
}

bool LeaseIsLive(const Lease& lease, double now, std::string_view this_host, int64_t this_pid,
                 bool (*process_exists)(int64_t pid)) {
  if (lease.host == this_host) {
    // This process holds the run through its lock, if at all; another process of this host is
    // known to be gone when its pid is.
    if (lease.pid == this_pid || !process_exists(lease.pid)) return false;
  }
  return now - lease.heartbeat < kLeaseStaleAfterSeconds;  // a lease from the future is live
}

// Rewrites LEASE every kLeasePeriodSeconds on a thread of its own until destroyed, then removes
// it if it is still this driver's.
class LeaseKeeper {
 public:
  LeaseKeeper(std::string path, Lease lease) : path_(std::move(path)), lease_(std::move(lease)) {}
  ~LeaseKeeper() {
    {
      MutexLock l(mu_);
      stop_ = true;
    }
    stopped_.NotifyAll();
    if (thread_.joinable()) thread_.join();
    auto text = ReadFile(path_);
    std::optional<Lease> there = text.ok() ? ParseLease(*text) : std::nullopt;
    if (there && there->host == lease_.host && there->pid == lease_.pid) unlink(path_.c_str());
  }
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

  // Writes the lease once, then starts renewing it.
  Status Start() {
    JT_RETURN_IF_ERROR(Write());
    thread_ = std::thread([this] { Renew(); });
    return OkStatus();
  }

 private:
  Status Write() {
    lease_.heartbeat = RealClock().UnixSeconds();
    return WriteFileAtomically(path_, LeaseText(lease_));
  }

  void Renew() {
    MutexLock l(mu_);
    while (!stopped_.WaitFor(mu_, std::chrono::duration<double>(kLeasePeriodSeconds),
                             [this]() REQUIRES(mu_) { return stop_; })) {
      // A failed write (the storage unreachable for a while) is retried at the next period.
      (void)Write();
    }
  }

  const std::string path_;
  Lease lease_;  // written by the renewing thread only once it runs
  Mutex mu_;
  CondVar stopped_;
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

StatusOr<RunStore> RunStore::Open(std::string run_dir) {
  JT_RETURN_IF_ERROR(MakeDirs(JoinPath(run_dir, "logs")));
  if (access(run_dir.c_str(), W_OK) != 0) {
    return PermissionDeniedError("cannot write to the run directory '" + run_dir +
                                 "'; choose a RunConfig.storage_path you can write to");
  }
  const std::string lock_path = JoinPath(run_dir, kLockName);
  int fd = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return PathError("cannot open the run's lock", lock_path, errno);
  struct flock lock = WholeFile(F_WRLCK);
  if (fcntl(fd, F_OFD_SETLK, &lock) != 0) {
    const int err = errno;
    std::string holder = DescribeHolder(ReadAll(fd));
    close(fd);
    if (err != EAGAIN && err != EACCES) return PathError("cannot lock", lock_path, err);
    return FailedPreconditionError(
        "the run directory '" + run_dir + "' is in use by another driver (" +
        (holder.empty() ? "its LOCK does not say which" : holder) +
        "): a run has one driver at a time. Wait for that run to end or stop it, or choose "
        "another RunConfig.name");
  }
  // The lock was free here; on a mount whose locks stay on each host, a driver elsewhere shows
  // itself by its lease.
  if (std::string holder = LiveLease(run_dir); !holder.empty()) {
    close(fd);
    return FailedPreconditionError(
        "the run directory '" + run_dir + "' is in use by another driver (" + holder +
        "; its file lock is not visible from this host, its lease is, and counts until " +
        std::to_string(static_cast<int>(kLeaseStaleAfterSeconds)) +
        " s without renewal): a run has one driver at a time. Wait for that run to end or stop "
        "it, or choose another RunConfig.name");
  }
  RunStore store(std::move(run_dir));
  store.lock_fd_ = fd;
  store.previous_holder_ = DescribeHolder(ReadAll(fd));
  const std::string me = ThisDriver();
  if (ftruncate(fd, 0) != 0 || lseek(fd, 0, SEEK_SET) != 0) {
    return PathError("cannot write", lock_path, errno);
  }
  JT_RETURN_IF_ERROR(WriteFd(fd, me, lock_path));
  const double now = RealClock().UnixSeconds();
  store.lease_ = std::make_unique<LeaseKeeper>(
      JoinPath(store.dir_, kLeaseName),
      Lease{.host = ThisHost(), .pid = getpid(), .since = std::floor(now), .heartbeat = now});
  JT_RETURN_IF_ERROR(store.lease_->Start());
  // A resumed run keeps the columns progress.csv already has.
  auto csv = ReadFile(JoinPath(store.dir_, "progress.csv"));
  if (csv.ok() && !csv->empty()) {
    std::istringstream header(csv->substr(0, csv->find('\n')));
    for (std::string col; std::getline(header, col, ',');) store.csv_columns_.push_back(col);
  }
  return store;
}

StatusOr<std::optional<std::string>> RunStore::LockHolder(const std::string& run_dir) {
  const std::string lock_path = JoinPath(run_dir, kLockName);
  int fd = open(lock_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno != ENOENT && errno != ENOTDIR) {
      return PathError("cannot open the run's lock", lock_path, errno);
    }
    std::string lease = LiveLease(run_dir);
    return lease.empty() ? std::nullopt : std::optional<std::string>(lease);
  }
  struct flock lock = WholeFile(F_WRLCK);
  if (fcntl(fd, F_OFD_GETLK, &lock) != 0) {
    const int err = errno;
    close(fd);
    return PathError("cannot query the lock", lock_path, err);
  }
  std::optional<std::string> holder;
  if (lock.l_type != F_UNLCK) {
    holder = DescribeHolder(ReadAll(fd));
    if (holder->empty()) holder = "a driver that LOCK does not name";
  }
  close(fd);
  if (!holder) {
    if (std::string lease = LiveLease(run_dir); !lease.empty()) holder = lease;
  }
  return holder;
}

RunStore::RunStore(std::string dir) : dir_(std::move(dir)) {}

RunStore::RunStore(RunStore&& other) noexcept
    : dir_(std::move(other.dir_)),
      lock_fd_(std::exchange(other.lock_fd_, -1)),
      lease_(std::move(other.lease_)),
      previous_holder_(std::move(other.previous_holder_)),
      csv_columns_(std::move(other.csv_columns_)) {}

RunStore& RunStore::operator=(RunStore&& other) noexcept {
  if (this != &other) {
    Unlock();
    dir_ = std::move(other.dir_);
    lock_fd_ = std::exchange(other.lock_fd_, -1);
    lease_ = std::move(other.lease_);
    previous_holder_ = std::move(other.previous_holder_);
    csv_columns_ = std::move(other.csv_columns_);
  }
  return *this;
}

RunStore::~RunStore() { Unlock(); }

void RunStore::Unlock() {
  lease_.reset();  // stops renewing and removes LEASE, before another driver may take the lock
  if (lock_fd_ >= 0) close(lock_fd_);  // closing the last descriptor of the OFD releases it
  lock_fd_ = -1;
}

uint64_t RunStore::LastRound() const {
  std::string tail = TailOfFile(JoinPath(dir_, "result.jsonl"), 1 << 16);
  // The last whole line; a torn one (a crash mid-append) is not a round.
  while (!tail.empty()) {
    size_t end = tail.find_last_not_of('\n');
    if (end == std::string::npos) break;
    tail.resize(end + 1);
    size_t start = tail.rfind('\n');
    auto line = nlohmann::json::parse(tail.substr(start == std::string::npos ? 0 : start + 1),
                                      nullptr, false);
    if (line.is_object() && line.contains("round")) return line["round"].get<uint64_t>();
    tail.resize(start == std::string::npos ? 0 : start);
  }
  return 0;
}

nlohmann::json RunStore::PreviousRunState() const {
  auto text = ReadFile(JoinPath(dir_, "run.json"));
  if (!text.ok()) return nullptr;
  auto state = nlohmann::json::parse(*text, nullptr, false);
  return state.is_object() ? state : nullptr;
}

std::string RunStore::LogPath(int rank) const {
  return JoinPath(dir_, "logs/rank-" + std::to_string(rank) + ".log");
}

Status RunStore::WriteRunState(const nlohmann::json& state) {
  return WriteFileAtomically(JoinPath(dir_, "run.json"), state.dump(2) + "\n");
}

Status RunStore::AppendRound(uint64_t round, double unix_time, std::string_view metrics_json,
                             std::string_view checkpoint_dir_name) {
  nlohmann::json metrics = ParseMetricsJson(metrics_json);
  if (!metrics.is_object()) {
    return InvalidArgumentError("report() metrics must be a dict; got: " +
                                std::string(metrics_json.substr(0, 200)));
  }
  std::ostringstream line;
  line.precision(17);
  line << "{\"round\":" << round << ",\"time\":" << unix_time << ",\"metrics\":" << metrics_json;
  if (!checkpoint_dir_name.empty()) {
    line << ",\"checkpoint\":" << nlohmann::json(std::string(checkpoint_dir_name)).dump();
  }
  line << "}\n";
  const std::string jsonl = JoinPath(dir_, "result.jsonl");
  const uint64_t jsonl_size = FileSize(jsonl);
  JT_RETURN_IF_ERROR(AppendToFile(jsonl, line.str()));

  std::vector<std::pair<std::string, std::string>> flat;
  Flatten(metrics, "", &flat);
  std::string csv;
  const bool new_columns = csv_columns_.empty();
  if (new_columns) {
    csv_columns_ = {std::string(kRoundColumn), std::string(kTimeColumn)};
    for (const auto& [k, v] : flat) csv_columns_.push_back(k);
    for (size_t i = 0; i < csv_columns_.size(); ++i) {
      csv += (i ? "," : "") + CsvField(csv_columns_[i]);
    }
    csv += "\n";
  }
  std::ostringstream time_text;
  time_text.precision(17);
  time_text << unix_time;
  // The first two columns are jaxtrain's, by position: a progress.csv of an earlier version
  // (headed "round,time") is continued the same way, and a metric of the same name as one of
  // them has a column of its own.
  for (size_t i = 0; i < csv_columns_.size(); ++i) {
    std::string value;
    if (i == 0) {
      value = std::to_string(round);
    } else if (i == 1) {
      value = time_text.str();
    } else {
      for (const auto& [k, v] : flat) {
        if (k == csv_columns_[i]) value = v;
      }
    }
    csv += (i ? "," : "") + CsvField(value);
  }
  csv += "\n";
  Status s = AppendToFile(JoinPath(dir_, "progress.csv"), csv);
  if (!s.ok()) {
    if (new_columns) csv_columns_.clear();  // the header was not written either
    Status undone = TruncateFile(jsonl, jsonl_size);
    if (!undone.ok()) return Status(s.code(), s.message() + "; and " + undone.message());
  }
  return s;
}

Status RunStore::WriteError(std::string_view text) {
  return WriteFileAtomically(JoinPath(dir_, "error.txt"), text);
}

}  // namespace jaxtrain::storage
