#include "launch/standby_pool.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "base/fd_io.h"
#include "launch/process.h"
#include "nlohmann/json.hpp"

namespace jaxtrain::launch {
namespace {

constexpr char kStandbyEnv[] = "JAXTRAIN_STANDBY";
constexpr char kWarmWorkersEnv[] = "JAXTRAIN_WARM_WORKERS";

void EndStandby(Standby& s) {
  if (s.activation_fd >= 0) close(s.activation_fd);
  kill(s.process.pid, SIGKILL);
  WaitForExit(s.process.pid);
  close(s.process.pidfd);
  close(s.process.output_fd);
  s = Standby{};
}

// Starts the standby of `spec` in group `pgid` (0: a new one).
StatusOr<Standby> StartStandby(const ProcessSpec& spec, pid_t pgid) {
  std::map<std::string, std::string> env = LocalEnvironment(spec);
  for (const char* name : kActivationEnv) env.erase(name);
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return ErrnoError("pipe2", errno);
  int read_fd = fds[0];
  if (read_fd < 3) {  // 0-2 are the child's stdio (a driver started with stdin closed)
    read_fd = fcntl(fds[0], F_DUPFD_CLOEXEC, 3);
    const int err = errno;
    close(fds[0]);
    if (read_fd < 0) {
      close(fds[1]);
      return ErrnoError("fcntl(F_DUPFD_CLOEXEC)", err);
    }
  }
  env[kStandbyEnv] = "1";
  env[kSecretFdEnv] = std::to_string(read_fd);
  auto started = StartLocalProcess(spec, EnvironmentEntries(env), pgid, read_fd);
  close(read_fd);
  if (!started.ok()) {
    close(fds[1]);
    return started.status();
  }
  return Standby{.key = StandbyKey(spec), .process = *started, .activation_fd = fds[1]};
}

}  // namespace

bool IsActivationName(const std::string& name) {
  return std::any_of(std::begin(kActivationEnv), std::end(kActivationEnv),
                     [&](const char* a) { return name == a; });
}

std::map<std::string, std::string> LocalEnvironment(const ProcessSpec& spec) {
  std::map<std::string, std::string> env = CurrentEnvironment();
  // A driver that is itself a worker of another run must not hand that run's secret on.
  for (const char* name : {"JAXTRAIN_RUN_SECRET", "JAXTRAIN_RUN_SECRET_FILE", kSecretFdEnv}) {
    env.erase(name);
  }
  for (const auto& name : spec.unset_env) env.erase(name);
  for (const auto& [k, v] : spec.Env()) env[k] = v;
  return env;
}

std::vector<std::string> EnvironmentEntries(const std::map<std::string, std::string>& env) {
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

std::string RanksText(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ",") + std::to_string(r);
  return out;
}

StatusOr<bool> WarmWorkersRequested() {
  const char* value = std::getenv(kWarmWorkersEnv);
  if (value == nullptr || std::string_view(value) == "1") return true;
  if (std::string_view(value) == "0") return false;
  return InvalidArgumentError(std::string(kWarmWorkersEnv) + "='" + value +
                              "' is not allowed: use 1 (the default: workers are started ahead "
                              "of their attempt, docs/warm-workers.md) or 0 (every attempt "
                              "starts fresh processes)");
}

StatusOr<std::string> ReadPreloadFile(const std::string& path, size_t limit) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return UnavailableError("cannot read " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) > limit) {
    close(fd);
    return ResourceExhaustedError("the pickled function is " + std::to_string(st.st_size) +
                                  " bytes, more than the " + std::to_string(limit) +
                                  " shipped to standbys");
  }
  auto bytes = ReadAll(fd);
  close(fd);
  return bytes;
}

std::string StandbyKey(const ProcessSpec& spec) {
  // NUL cannot occur in an argument or an environment entry: the fields cannot run together.
  std::string key = "ranks=" + RanksText(spec.ranks) + '\0' + "cwd=" + spec.cwd + '\0';
  for (const auto& a : spec.argv) key += "arg=" + a + '\0';
  for (const auto& [k, v] : LocalEnvironment(spec)) {
    if (!IsActivationName(k)) key += "env=" + k + "=" + v + '\0';
  }
  return key;
}

StatusOr<LaunchedProcess> StartLocalProcess(const ProcessSpec& spec,
                                            const std::vector<std::string>& env, pid_t pgid,
                                            int inherit_fd) {
  JT_ASSIGN_OR_RETURN(Spawned spawned, SpawnWithOutputPipe({.argv = spec.argv,
                                                            .env = &env,
                                                            .cwd = spec.cwd,
                                                            .process_group = pgid,
                                                            .inherit_fd = inherit_fd}));
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, spawned.pid, 0));
  if (pidfd < 0) {
    const int err = errno;
    kill(spawned.pid, SIGKILL);
    WaitForExit(spawned.pid);
    close(spawned.output_fd);
    return UnavailableError(std::string("pidfd_open: ") + std::strerror(err));
  }
  fcntl(pidfd, F_SETFD, FD_CLOEXEC);
  fcntl(spawned.output_fd, F_SETFL, fcntl(spawned.output_fd, F_GETFL) | O_NONBLOCK);
  return LaunchedProcess{spec.ranks, spawned.pid, pidfd, spawned.output_fd};
}

std::string ActivationMessage(const std::string& secret,
                              const std::map<std::string, std::string>& env) {
  nlohmann::json overrides = nlohmann::json::object();
  for (const char* name : kActivationEnv) {
    if (auto it = env.find(name); it != env.end()) overrides[name] = it->second;
  }
  return nlohmann::json{{"secret", secret}, {"env", overrides}}.dump();
}

Status Activate(Standby& standby, const ProcessSpec& spec) {
  const std::string activation = ActivationMessage(spec.secret, LocalEnvironment(spec));
  int err = 0;
  Status written = WriteAll(standby.activation_fd, activation, "write", &err);
  close(standby.activation_fd);
  standby.activation_fd = -1;
  if (!written.ok()) {
    return UnavailableError("cannot activate the standby worker of rank " +
                            RanksText(standby.process.ranks) + ": " + std::strerror(err));
  }
  return OkStatus();
}

StandbyPool& StandbyPool::Driver() {
  static StandbyPool* pool = new StandbyPool();  // never destroyed: see the header
  return *pool;
}

StandbyPool::~StandbyPool() {
  MutexLock lock(mu_);
  for (Set& set : sets_) EndSet(set);
}

void StandbyPool::EndSet(Set& set) {
  // The set's group goes first, so that no child a standby started (a shell's command, a
  // subprocess of its imports) outlives it. Safe against a reused id: while one member is
  // unreaped, zombie or alive, its group id cannot be given to anyone else.
  const bool unreaped = std::any_of(set.members.begin(), set.members.end(),
                                    [](const Standby& s) { return s.process.pid > 0; });
  if (unreaped && set.pgid > 0) killpg(set.pgid, SIGKILL);
  for (Standby& s : set.members) {
    if (s.process.pid > 0) EndStandby(s);
  }
  set.members.clear();
}

Status StandbyPool::Prepare(const void* owner, const std::vector<ProcessSpec>& specs) {
  MutexLock lock(mu_);
  for (const Set& set : sets_) {
    if (set.owner == owner) return OkStatus();
  }
  Set set{.owner = owner};
  for (const ProcessSpec& spec : specs) {
    auto standby = StartStandby(spec, set.pgid);
    if (!standby.ok()) {
      EndSet(set);
      return UnavailableError("cannot start the standby worker of rank " + RanksText(spec.ranks) +
                              ": " + standby.status().message());
    }
    if (set.pgid == 0) set.pgid = standby->process.pid;
    set.members.push_back(std::move(*standby));
  }
  sets_.push_back(std::move(set));
  return OkStatus();
}

std::optional<StandbyPool::Taken> StandbyPool::Take(const void* owner,
                                                    const std::vector<ProcessSpec>& specs,
                                                    std::vector<std::string>* notes) {
  std::vector<std::string> keys;
  for (const ProcessSpec& spec : specs) keys.push_back(StandbyKey(spec));
  auto matches = [&](const Set& set) {
    if (set.members.size() != keys.size()) return false;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (set.members[i].key != keys[i]) return false;
    }
    return true;
  };
  MutexLock lock(mu_);
  auto chosen = std::find_if(sets_.begin(), sets_.end(),
                             [&](const Set& s) { return s.owner == owner && matches(s); });
  if (chosen == sets_.end()) {
    chosen = std::find_if(sets_.begin(), sets_.end(),
                          [&](const Set& s) { return s.owner == nullptr && matches(s); });
  }
  std::optional<Taken> taken;
  if (chosen != sets_.end()) {
    taken = Taken{.pgid = chosen->pgid};
    bool any_alive = false;
    for (Standby& s : chosen->members) {
      if (auto exit = TryReap(s.process.pid)) {
        notes->push_back("the standby worker of rank " + RanksText(s.process.ranks) + " " +
                         exit->ToString() + " before it was used; starting a fresh process");
        close(s.activation_fd);
        close(s.process.pidfd);
        close(s.process.output_fd);
        taken->slots.emplace_back();
      } else {
        any_alive = true;
        taken->slots.emplace_back(std::move(s));
      }
    }
    if (!any_alive) taken.reset();  // their group may be gone: nothing to join
    chosen->members.clear();
    sets_.erase(chosen);
  }
  // Free sets of other keys wait for no one (one generation is kept).
  for (Set& set : sets_) {
    if (set.owner == nullptr) EndSet(set);
  }
  std::erase_if(sets_, [](const Set& s) { return s.members.empty(); });
  return taken;
}

void StandbyPool::Release(const void* owner) {
  MutexLock lock(mu_);
  for (Set& set : sets_) {
    if (set.owner == owner) set.owner = nullptr;
  }
}

void StandbyPool::End(const void* owner) {
  MutexLock lock(mu_);
  for (Set& set : sets_) {
    if (set.owner == owner) EndSet(set);
  }
  std::erase_if(sets_, [](const Set& s) { return s.members.empty(); });
}

size_t StandbyPool::EndFree() {
  MutexLock lock(mu_);
  size_t ended = 0;
  for (Set& set : sets_) {
    if (set.owner != nullptr) continue;
    ended += set.members.size();
    EndSet(set);
  }
  std::erase_if(sets_, [](const Set& s) { return s.members.empty(); });
  return ended;
}

size_t StandbyPool::size() const {
  MutexLock lock(mu_);
  size_t n = 0;
  for (const Set& set : sets_) n += set.members.size();
  return n;
}

}  // namespace jaxtrain::launch
