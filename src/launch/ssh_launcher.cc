#include "launch/ssh_launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "base/fd_io.h"
#include "base/strings.h"
#include "launch/process.h"
#include "launch/standby_pool.h"

namespace jaxtrain::launch {
namespace {

// The agent that runs each worker on its host (see ssh_launcher.h). argv[1] names the host in
// its messages. Exit codes of its own: 126 no working directory, 127 the worker cannot start.
constexpr char kAgentSource[] = R"PY(
import json, os, signal, subprocess, sys, threading
host = sys.argv[1]
def line():
    b = bytearray()
    while True:
        c = os.read(0, 1)
        if not c:
            return None
        if c == b"\n":
            return bytes(b)
        b += c
h = line()
if h is None:
    sys.exit(0)
h = json.loads(h)
env = dict(os.environ)
for k in h["unset"]:
    env.pop(k, None)
env.update(h["env"])
try:
    if h["cwd"]:
        os.chdir(h["cwd"])
except OSError as e:
    sys.stderr.write(f"jaxtrain: cannot enter the working directory on {host}: {e}\n")
    sys.exit(126)
def orphan_guard():
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
fds = ()
standby = None
preload = None
if h.get("standby"):
    r, standby = os.pipe()
    env["JAXTRAIN_STANDBY"] = "1"
    env["JAXTRAIN_RUN_SECRET_FD"] = str(r)
    fds = (r,)
    if h.get("preload"):
        import base64, tempfile
        fd, preload = tempfile.mkstemp(prefix="jaxtrain-preload-")
        os.write(fd, base64.b64decode(h["preload"]))
        os.close(fd)
        env["JAXTRAIN_PRELOAD_FILE"] = preload
elif h.get("secret"):
    r, w = os.pipe()
    os.write(w, h["secret"].encode())
    os.close(w)
    env["JAXTRAIN_RUN_SECRET_FD"] = str(r)
    fds = (r,)
try:
    p = subprocess.Popen(h["argv"], env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                         preexec_fn=orphan_guard, pass_fds=fds)
    for fd in fds:
        os.close(fd)
except OSError as e:
    sys.stderr.write(f"jaxtrain: cannot start {h['argv'][0]} on {host}: {e}\n")
    sys.exit(127)
def unlink_preload():
    if preload:
        try:
            os.unlink(preload)
        except OSError:
            pass
if standby is not None:
    lock = threading.Lock()
    state = []
    def early():
        rc = p.wait()
        with lock:
            if not state:
                state.append("gone")
                unlink_preload()
                os._exit(128 - rc if rc < 0 else rc)
    threading.Thread(target=early, daemon=True).start()
    a = line()
    with lock:
        if a is None or state:
            unlink_preload()
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            os._exit(0)
        state.append("active")
    try:
        os.write(standby, a)
    except OSError:
        pass
    os.close(standby)
def kill(sig):
    try:
        os.killpg(p.pid, sig)
    except OSError:
        pass
def watch():
    while (word := line()) is not None:
        sig = getattr(signal, "SIG" + word.decode().strip(), None)
        if sig is not None:
            kill(sig)
    kill(signal.SIGKILL)
threading.Thread(target=watch, daemon=True).start()
rc = p.wait()
kill(signal.SIGKILL)
unlink_preload()
if rc < 0:
    sys.stderr.write(f"jaxtrain: the worker on {host} was killed by signal {-rc} "
                     f"({signal.Signals(-rc).name})\n")
    rc = 128 - rc
sys.stdout.flush()
sys.stderr.flush()
os._exit(rc)
)PY";

// Exit codes of the probe's remote command, and ssh's own for a connection that failed.
constexpr int kSshFailed = 255;
constexpr int kProbeNoPython = 97;
constexpr int kProbeNoCwd = 98;
// The least time an elastic run's probe gives a host to answer, however near its deadline: an ssh
// login to a healthy host (the key exchange, the remote shell) takes a second or two on a busy
// machine.
constexpr Duration kShortestProbe = std::chrono::seconds(5);

std::vector<std::string> Split(std::string_view text, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(sep, start);
    if (end == std::string_view::npos) end = text.size();
    out.push_back(Trim(text.substr(start, end - start)));
    start = end + 1;
  }
  return out;
}

std::optional<int> ParseSlots(std::string_view s) {
  if (s.empty() || s.size() > 6) return std::nullopt;
  int v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  if (v < 1) return std::nullopt;
  return v;
}

// ssh's last words: its error lines, without the warnings it adds on the way.
std::string LastLines(const std::string& output) {
  std::string out;
  for (const auto& line : Split(output, '\n')) {
    if (line.empty() || line.rfind("Warning: Permanently added", 0) == 0) continue;
    out += (out.empty() ? "" : " / ") + line;
  }
  return out.size() > 600 ? out.substr(out.size() - 600) : out;
}

std::string HintFor(const std::string& said, const std::string& target) {
  if (said.find("Host key verification failed") != std::string::npos) {
    return "; its host key is not known here (or has changed): check it and add it to "
           "~/.ssh/known_hosts (e.g. ssh-keyscan " +
           target + "), then try again";
  }
  if (said.find("Permission denied") != std::string::npos) {
    return "; the host refused every key offered: add this host's public key to its "
           "~/.ssh/authorized_keys, or load the key into ssh-agent";
  }
  return "; check that it is up and runs sshd, and that 'ssh -o BatchMode=yes " + target +
         " true' works from this host without a prompt";
}

// write() that reports EPIPE instead of raising SIGPIPE (the driver may not ignore it): the
// signal is blocked for this thread meanwhile, and a pending one consumed.
ssize_t WriteNoSigpipe(int fd, std::string_view data) {
  sigset_t pipe_set, old;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
  ssize_t n;
  do {
    n = write(fd, data.data(), data.size());
  } while (n < 0 && errno == EINTR);
  if (n < 0 && errno == EPIPE) {
    const timespec zero{};
    sigtimedwait(&pipe_set, nullptr, &zero);
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return n;
}

// The driver's variables every worker gets (kForwardedPrefixes, and those JAXTRAIN_SSH_ENV names).
nlohmann::json ForwardedEnvironment() {
  std::vector<std::string> extra_names;
  for (auto& w : Split(CurrentEnvironment()[kSshEnvEnv], ',')) {
    if (!w.empty()) extra_names.push_back(w);
  }
  nlohmann::json forwarded = nlohmann::json::object();
  for (const auto& [k, v] : CurrentEnvironment()) {
    bool pass = std::find(extra_names.begin(), extra_names.end(), k) != extra_names.end();
    for (auto prefix : kForwardedPrefixes) pass = pass || k.rfind(prefix, 0) == 0;
    if (pass) forwarded[k] = v;
  }
  return forwarded;
}

// The environment an agent starts `spec`'s worker with: `forwarded`, less spec.unset_env, plus
// spec.Env(), less kPreloadFileEnv (a path of this host: a standby gets the file's bytes).
nlohmann::json AgentEnvironment(const ProcessSpec& spec, const nlohmann::json& forwarded) {
  nlohmann::json env = forwarded;
  for (const auto& name : spec.unset_env) env.erase(name);
  for (const auto& [k, v] : spec.Env()) env[k] = v;
  env.erase(kPreloadFileEnv);
  return env;
}

std::string Remote(const std::vector<std::string>& words) {
  std::string out;
  for (const auto& w : words) out += (out.empty() ? "" : " ") + ShellQuote(w);
  return out;
}

}  // namespace

std::string Base64(std::string_view data) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((data.size() + 2) / 3 * 4);
  for (size_t i = 0; i < data.size(); i += 3) {
    uint32_t n = static_cast<uint32_t>(static_cast<unsigned char>(data[i])) << 16;
    if (i + 1 < data.size())
      n |= static_cast<uint32_t>(static_cast<unsigned char>(data[i + 1])) << 8;
    if (i + 2 < data.size()) n |= static_cast<unsigned char>(data[i + 2]);
    out += kAlphabet[(n >> 18) & 63];
    out += kAlphabet[(n >> 12) & 63];
    out += i + 1 < data.size() ? kAlphabet[(n >> 6) & 63] : '=';
    out += i + 2 < data.size() ? kAlphabet[n & 63] : '=';
  }
  return out;
}

std::string AgentCommand(const std::string& python, const std::string& target) {
  // The program travels as base64 inside one line: a csh or tcsh login shell refuses a newline
  // inside quotes, and the line holds no character that any of the shells treats specially
  // between single quotes.
  const std::string program =
      "import base64; exec(base64.b64decode(\"" + Base64(kAgentSource) + "\"))";
  return "exec " + Remote({python, "-c", program, target});
}

std::string ShellQuote(std::string_view s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

StatusOr<std::vector<SshHost>> ParseSshHosts(std::string_view text, const std::string& source,
                                             bool hostfile) {
  std::vector<SshHost> hosts;
  std::set<std::string> seen;
  int line_number = 0;
  for (std::string entry : Split(text, hostfile ? '\n' : ',')) {
    ++line_number;
    if (hostfile) entry = Trim(entry.substr(0, entry.find('#')));
    if (entry.empty()) {
      if (hostfile) continue;
      return InvalidArgumentError(source + " has an empty entry; list hosts as h1,h2 or h1:4,h2:4");
    }
    const std::string where = hostfile ? source + " line " + std::to_string(line_number)
                                       : source + " entry '" + entry + "'";
    SshHost host;
    if (hostfile) {
      std::vector<std::string> words;
      std::replace(entry.begin(), entry.end(), '\t', ' ');
      for (auto& w : Split(entry, ' ')) {
        if (!w.empty()) words.push_back(w);
      }
      host.target = words.front();
      for (size_t i = 1; i < words.size(); ++i) {
        const std::string& w = words[i];
        if (w.rfind("slots=", 0) == 0) {
          host.slots = ParseSlots(w.substr(6));
          if (!host.slots) {
            return InvalidArgumentError(where + ": '" + w +
                                        "' is not allowed; slots must be a whole number >= 1");
          }
        } else if (w.rfind("max_slots=", 0) != 0 &&  // MPI's cap: more than slots never run
                   w.rfind("labels=", 0) != 0) {     // what label_selector picks by (hosts/join.py)
          return InvalidArgumentError(where + ": '" + w +
                                      "' is not allowed; a line is 'host' or 'host slots=N', with "
                                      "labels=key=value,... optionally");
        }
      }
    } else {
      size_t colon = entry.rfind(':');
      host.target = entry.substr(0, colon);
      if (colon != std::string::npos) {
        host.slots = ParseSlots(entry.substr(colon + 1));
        if (!host.slots) {
          return InvalidArgumentError(where + ": '" + entry.substr(colon + 1) +
                                      "' is not allowed; the workers of a host (h1:4) must be a "
                                      "whole number >= 1");
        }
      }
    }
    if (host.target.empty()) return InvalidArgumentError(where + ": no host name");
    JT_RETURN_IF_ERROR(placement::CheckHostName(host.target, where));
    if (!seen.insert(host.target).second) {
      return InvalidArgumentError(where + ": host '" + host.target +
                                  "' is listed twice; list each host once, with its slots");
    }
    hosts.push_back(std::move(host));
  }
  if (hosts.empty()) return InvalidArgumentError(source + " lists no host");
  return hosts;
}

placement::HostDescription SshHostDescription(const std::vector<SshHost>& hosts,
                                              const std::string& source,
                                              const config::ScalingConfig& config) {
  placement::HostDescription d{.source = source};
  const int n = config.num_workers();
  const int share = (n + static_cast<int>(hosts.size()) - 1) / static_cast<int>(hosts.size());
  const auto cpu = config.resources_per_worker().find("CPU");
  const double cpu_per_worker = cpu == config.resources_per_worker().end() ? 1 : cpu->second;
  for (const SshHost& h : hosts) {
    const int slots = h.slots.value_or(share);
    placement::Host host;
    host.name = h.target;
    host.address = h.target.substr(h.target.find('@') + 1);
    if (config.use_gpu()) {
      for (int g = 0; g < slots; ++g) host.gpus.push_back(std::to_string(g));
    } else {
      host.cpus = std::max(1, static_cast<int>(std::ceil(slots * cpu_per_worker - 1e-9)));
    }
    d.hosts.push_back(std::move(host));
  }
  return d;
}

StatusOr<placement::Plan> PlanForSsh(const config::ScalingConfig& config,
                                     const accelerators::HostView& env) {
  return PlanForSshOn(config, env, std::nullopt);
}

StatusOr<placement::Plan> PlanForSshOn(const config::ScalingConfig& config,
                                       const accelerators::HostView& env,
                                       const std::optional<ElasticShare>& share) {
  placement::Environment inherited = CurrentEnvironment();
  const bool simulate = [&] {
    auto v = env.GetEnv(placement::kSimulateEnv);
    return v && !v->empty() && *v != "0";
  }();
  placement::HostDescription hosts;
  auto hostfile = env.GetEnv(kHostfileEnv);
  auto list = env.GetEnv(kSshHostsEnv);
  auto json = env.GetEnv(placement::kHostsEnv);
  if (hostfile && !hostfile->empty()) {
    auto text = env.ReadFile(*hostfile);
    if (!text) {
      return NotFoundError(std::string(kHostfileEnv) + "='" + *hostfile +
                           "' cannot be read; name a hostfile with one 'host slots=N' per line");
    }
    std::string source = std::string(kHostfileEnv) + "=" + *hostfile;
    JT_ASSIGN_OR_RETURN(auto parsed, ParseSshHosts(*text, source, true));
    hosts = SshHostDescription(parsed, source, config);
  } else if (list && !list->empty()) {
    std::string source = std::string(kSshHostsEnv) + "='" + *list + "'";
    JT_ASSIGN_OR_RETURN(auto parsed, ParseSshHosts(*list, source, false));
    hosts = SshHostDescription(parsed, source, config);
  } else if (json && !json->empty()) {
    JT_ASSIGN_OR_RETURN(hosts, placement::LoadHostDescription(env, *json, inherited));
  } else {
    return InvalidArgumentError(
        "the ssh launcher needs the hosts to run on: set JAXTRAIN_SSH_HOSTS=h1,h2 (or h1:4,h2:4), "
        "JAXTRAIN_HOSTFILE to a file of 'host slots=N' lines, or JAXTRAIN_HOSTS to a JSON host "
        "description (jaxtrain run: --hosts, --hostfile)");
  }
  if (!share) {
    JT_ASSIGN_OR_RETURN(placement::Plan plan,
                        placement::PlanOnHosts(config, hosts, inherited, simulate));
    JT_RETURN_IF_ERROR(placement::CheckElasticHosts(config, plan));
    return plan;
  }
  // The hosts as described for the full run (their slots from its max), only those kept.
  JT_ASSIGN_OR_RETURN(config::ScalingConfig fewer, config.WithWorkers(share->workers));
  return placement::PlanOnHosts(
      fewer,
      placement::OnlyHosts(hosts, std::set<std::string>(share->hosts.begin(), share->hosts.end())),
      inherited, simulate);
}

std::vector<std::string> SshCommand(const accelerators::HostView& env) {
  std::vector<std::string> out;
  for (auto& w : Split(env.GetEnv(kSshCommandEnv).value_or(""), ' ')) {
    if (!w.empty()) out.push_back(w);
  }
  if (out.empty()) out.push_back("ssh");
  return out;
}

StatusOr<std::string> ListenHostForSsh(const std::vector<std::string>& ssh,
                                       const std::vector<std::string>& targets) {
  auto chosen = [&]() -> StatusOr<std::string> {
    std::string address;
    std::set<std::string> tried;
    for (const auto& target : targets) {
      if (!tried.insert(target).second) continue;
      JT_ASSIGN_OR_RETURN(std::string name, SshHostName(ssh, target));
      JT_ASSIGN_OR_RETURN(address, AddressTowards(name));
      if (address.rfind("127.", 0) != 0 && address != "::1") break;  // not this host
    }
    return address;
  }();
  if (!chosen.ok()) {
    return UnavailableError("cannot choose the address the hosts reach this driver at: " +
                            chosen.status().message() + "; set " + kListenHostEnv);
  }
  return chosen;
}

StatusOr<std::string> SshHostName(const std::vector<std::string>& ssh, const std::string& target) {
  std::vector<std::string> argv = ssh;
  argv.insert(argv.end(), {"-G", "--", target});
  auto spawned = SpawnWithOutputPipe({.argv = argv, .search_path = true});
  if (!spawned.ok()) {
    return UnavailableError("cannot start '" + ssh.front() + "': " + spawned.status().message());
  }
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = read(spawned->output_fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(spawned->output_fd);
  ExitStatus exit = WaitForExit(spawned->pid);
  for (const auto& line : Split(out, '\n')) {
    if (exit.ok() && line.rfind("hostname ", 0) == 0) return line.substr(9);
  }
  return UnavailableError("'ssh -G " + target + "' " + exit.ToString() + ": " + LastLines(out));
}

// --- SshLauncher --------------------------------------------------------------------------------

SshLauncher::SshLauncher(SshLauncherOptions options)
    : options_(std::move(options)), interrupt_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}

SshLauncher::~SshLauncher() {
  CloseInputs();
  EndStandbys();
  if (interrupt_fd_ >= 0) close(interrupt_fd_);
}

void SshLauncher::Interrupt() {
  if (interrupt_fd_ < 0) return;
  uint64_t one = 1;
  // Fails only when the counter would overflow, which leaves it readable: nothing is lost.
  [[maybe_unused]] ssize_t n = write(interrupt_fd_, &one, sizeof(one));
}

bool SshLauncher::Interrupted() const {
  pollfd p{interrupt_fd_, POLLIN, 0};
  return interrupt_fd_ >= 0 && poll(&p, 1, 0) == 1;
}

void SshLauncher::CloseInputs() {
  for (int fd : inputs_) close(fd);
  inputs_.clear();
}

// ssh's words for a host that is down, rebooting or cut off: one that may come back.
bool MayComeBack(const std::string& said) {
  for (const char* words : {"Connection timed out", "Connection refused", "No route to host",
                            "Network is unreachable", "Connection reset", "Connection closed"}) {
    if (said.find(words) != std::string::npos) return true;
  }
  return false;
}

std::map<std::string, SshLauncher::HostCheck> SshLauncher::ChecksOf(
    const std::vector<ProcessSpec>& specs) const {
  std::map<std::string, HostCheck> hosts;
  for (const auto& spec : specs) {
    hosts.emplace(options_.targets[spec.ranks.front()],
                  HostCheck{.python = spec.argv.front(), .cwd = spec.cwd});
  }
  return hosts;
}

Status SshLauncher::Probe(const std::map<std::string, HostCheck>& hosts, int cancel_fd,
                          bool* reachable_later, std::vector<std::string>* unreachable,
                          Duration timeout) const {
  *reachable_later = false;
  if (unreachable) unreachable->clear();
  bool only_unreachable = true;
  struct Probing {
    std::string target;
    Spawned p;
    std::string output;
    bool open = true;
  };
  std::vector<Probing> probes;
  Status error;
  for (const auto& [target, check] : hosts) {
    std::string command = "true";
    if (!check.python.empty()) {
      command =
          "test -x " + ShellQuote(check.python) + " || exit " + std::to_string(kProbeNoPython);
    }
    if (!check.cwd.empty()) {
      command += "; cd " + ShellQuote(check.cwd) + " || exit " + std::to_string(kProbeNoCwd);
    }
    std::vector<std::string> argv = options_.ssh;
    argv.insert(argv.end(), kSshOptions.begin(), kSshOptions.end());
    argv.insert(argv.end(), {"--", target, command});
    auto spawned = SpawnWithOutputPipe({.argv = argv, .search_path = true});
    if (!spawned.ok()) {
      error = UnavailableError("cannot start '" + options_.ssh.front() + "' to reach " + target +
                               ": " + spawned.status().message() +
                               (spawned.status().code() == StatusCode::kNotFound
                                    ? " (is OpenSSH's client installed and on PATH?)"
                                    : ""));
      only_unreachable = false;
      break;
    }
    fcntl(spawned->output_fd, F_SETFL, fcntl(spawned->output_fd, F_GETFL) | O_NONBLOCK);
    probes.push_back({target, *spawned});
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool interrupted = false;
  for (;;) {
    std::vector<pollfd> fds;
    for (auto& p : probes) {
      if (p.open) fds.push_back({p.p.output_fd, POLLIN, 0});
    }
    if (fds.empty() || !error.ok()) break;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    fds.push_back({interrupt_fd_, POLLIN, 0});  // ignored by poll() when -1
    fds.push_back({cancel_fd, POLLIN, 0});
    poll(fds.data(), fds.size(), static_cast<int>(left.count()));
    if (fds[fds.size() - 2].revents != 0 || fds.back().revents != 0) {
      interrupted = true;  // every probe still running is killed below
      break;
    }
    for (auto& p : probes) {
      if (!p.open) continue;
      char buf[4096];
      for (;;) {
        ssize_t n = read(p.p.output_fd, buf, sizeof(buf));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) break;  // EAGAIN
        if (n == 0) {
          p.open = false;
          break;
        }
        p.output.append(buf, static_cast<size_t>(n));
      }
    }
  }
  std::vector<std::string> late;
  for (auto& p : probes) {
    close(p.p.output_fd);
    if (p.open) {
      kill(p.p.pid, SIGKILL);
      WaitForExit(p.p.pid);
      late.push_back(p.target);
      if (unreachable) unreachable->push_back(p.target);
      continue;
    }
    ExitStatus exit = WaitForExit(p.p.pid);
    if (exit.ok()) continue;
    if (exit.exit_code != kSshFailed || !MayComeBack(p.output)) {
      only_unreachable = false;
    } else if (unreachable) {
      unreachable->push_back(p.target);
    }
    if (!error.ok()) continue;
    const HostCheck& check = hosts.at(p.target);
    if (exit.exit_code == kProbeNoPython) {
      error = UnavailableError("host " + p.target + " has no executable " + check.python +
                               ": the workers run the driver's Python at the same path on every "
                               "host; install the same environment there");
    } else if (exit.exit_code == kProbeNoCwd) {
      error = UnavailableError("host " + p.target + " has no directory " + check.cwd +
                               ": the workers start in the driver's working directory, which "
                               "must exist on every host (shared storage, or the same checkout); "
                               "or give RunConfig(worker_runtime_env={'working_dir': ...}), "
                               "which is shipped to every host");
    } else {
      std::string said = LastLines(p.output);
      error = UnavailableError("cannot reach host " + p.target + " over ssh (" + exit.ToString() +
                               "): " + (said.empty() ? "ssh said nothing" : said) +
                               HintFor(said, p.target));
    }
  }
  if (interrupted) {
    return CancelledError("the run is being stopped: the hosts were not probed to the end");
  }
  *reachable_later = only_unreachable && (!error.ok() || !late.empty());
  if (!error.ok()) return error;
  if (!late.empty()) {
    std::string names;
    for (const auto& t : late) names += (names.empty() ? "" : ", ") + t;
    return DeadlineExceededError(
        "no answer over ssh within " +
        std::to_string(std::chrono::duration_cast<std::chrono::seconds>(timeout).count()) +
        " s from host " + names + "; check that it is up and reachable from this host");
  }
  return OkStatus();
}

Status SshLauncher::WaitForHosts(const std::map<std::string, HostCheck>& hosts, Status failed) {
  auto seconds = [](Duration d) {
    return FormatNumber(std::round(std::chrono::duration<double>(d).count() * 10) / 10);
  };
  const auto start = std::chrono::steady_clock::now();
  const auto give_up = start + options_.host_wait;
  const std::string limit =
      seconds(options_.host_wait) + " s (FailureConfig.unreachable_host_timeout_s)";
  Say("waiting up to " + limit + " for a host to come back: " + failed.message());
  Duration retry = options_.first_retry;
  bool reachable_later = true;
  while (reachable_later) {
    const auto now = std::chrono::steady_clock::now();
    const std::string waited = seconds(now - start);
    if (now >= give_up) {
      return Status(failed.code(), failed.message() + "; waited " + waited +
                                       " s for it to come back, the most that " + limit +
                                       " allows");
    }
    const Duration wait = std::min<Duration>(retry, give_up - now);
    Say("a host is unreachable after " + waited + " s; probing again in " + seconds(wait) + " s");
    pollfd p{interrupt_fd_, POLLIN, 0};  // ignored by poll() when -1
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(wait).count();
    if (poll(&p, 1, static_cast<int>(ms)) > 0) {
      return CancelledError("the run is being stopped: no workers are started");
    }
    retry = std::min<Duration>(retry * 2, options_.max_retry);
    failed = Probe(hosts, /*cancel_fd=*/-1, &reachable_later, nullptr);
    if (failed.ok()) {
      Say("the hosts answer again after " + seconds(std::chrono::steady_clock::now() - start) +
          " s; starting the workers");
    }
  }
  return failed;
}

StatusOr<std::vector<LaunchedProcess>> SshLauncher::Launch(const std::vector<ProcessSpec>& specs) {
  CloseInputs();
  running_.clear();
  cut_off_.clear();
  stop_signal_ = 0;
  pgid_ = 0;
  if (Interrupted()) return CancelledError("the run is being stopped: no workers are started");
  if (specs.empty()) return InvalidArgumentError("no processes to launch");
  for (const auto& spec : specs) {
    if (spec.ranks.size() != 1) {
      return InvalidArgumentError("the ssh launcher starts one process per rank");
    }
    int rank = spec.ranks.front();
    if (rank < 0 || static_cast<size_t>(rank) >= options_.targets.size()) {
      return InvalidArgumentError("rank " + std::to_string(rank) + " has no host to run on");
    }
  }
  std::vector<std::optional<Standby>> warm = TakeStandbys(specs);
  auto discard = [&](const std::set<std::string>& hosts, bool all) {
    for (size_t i = 0; i < warm.size(); ++i) {
      auto& slot = warm[i];
      const std::string& target = options_.targets[specs[i].ranks.front()];
      if (!slot || !(all || hosts.count(target) > 0)) continue;
      if (!all) {
        notes_.push_back("the standby worker of rank " + RanksText(specs[i].ranks) + " on " +
                         target + " is not used: its host did not answer; starting it afresh");
      }
      close(slot->input);
      kill(slot->process.pid, SIGKILL);
      WaitForExit(slot->process.pid);
      close(slot->process.pidfd);
      close(slot->process.output_fd);
      slot.reset();
    }
  };
  // Every host is probed, those with standbys too: a standby's connection may not have noticed
  // yet that its host is cut off (ssh's keepalive takes about 15 s), and one activated there would
  // fail the restart. A host that did not answer at first gets no standby of the attempt before.
  bool reachable_later = false;
  std::vector<std::string> unanswered;
  const std::map<std::string, HostCheck> checks = ChecksOf(specs);
  Status probed = Probe(checks, /*cancel_fd=*/-1, &reachable_later, &unanswered);
  if (!probed.ok() && reachable_later && launched_ && options_.host_wait > Duration::zero()) {
    probed = WaitForHosts(checks, std::move(probed));
  }
  if (!probed.ok()) discard({}, /*all=*/true);
  JT_RETURN_IF_ERROR(probed);
  discard({unanswered.begin(), unanswered.end()}, /*all=*/false);

  const nlohmann::json forwarded = ForwardedEnvironment();

  std::vector<LaunchedProcess> launched;
  auto fail = [&](Status s) -> Status {
    discard({}, /*all=*/true);
    if (pgid_ > 0) killpg(pgid_, SIGKILL);
    for (auto& l : launched) {
      WaitForExit(l.pid);
      close(l.pidfd);
      close(l.output_fd);
    }
    CloseInputs();
    running_.clear();
    pgid_ = 0;
    return s;
  };
  std::vector<int> warm_ranks;
  for (size_t i = 0; i < specs.size(); ++i) {
    const ProcessSpec& spec = specs[i];
    const std::string& target = options_.targets[spec.ranks.front()];
    if (warm[i]) {
      Standby standby = std::move(*warm[i]);
      warm[i].reset();
      const std::string activation = ActivationMessage(spec.secret, spec.Env()) + "\n";
      if (pgid_ == 0) pgid_ = standby_pgid_;
      launched.push_back(standby.process);
      running_[standby.process.pid] = target;
      inputs_.push_back(standby.input);
      // The agent reads its activation as soon as it is written (a few hundred bytes, far less
      // than the pipe holds); one that is gone meanwhile fails its rank's start, as a worker
      // that dies at once would.
      if (WriteNoSigpipe(standby.input, activation) != static_cast<ssize_t>(activation.size())) {
        notes_.push_back("the standby worker of rank " + RanksText(spec.ranks) + " on " + target +
                         " could not be activated; the restart notices it as that rank's end");
      }
      warm_ranks.insert(warm_ranks.end(), spec.ranks.begin(), spec.ranks.end());
      continue;
    }
    const nlohmann::json env = AgentEnvironment(spec, forwarded);
    const std::string header = nlohmann::json{{"argv", spec.argv},
                                              {"env", env},
                                              {"unset", spec.unset_env},
                                              {"cwd", spec.cwd},
                                              {"secret", spec.secret}}
                                   .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
                               "\n";
    int input = -1;
    auto started = StartAgent(spec, header, pgid_, &input);
    if (!started.ok()) return fail(started.status());
    if (pgid_ == 0) pgid_ = started->pid;
    launched.push_back(*started);
    running_[started->pid] = target;
    inputs_.push_back(input);
  }
  if (!warm_ranks.empty()) {
    details_.push_back("rank" + std::string(warm_ranks.size() > 1 ? "s " : " ") +
                       RanksText(warm_ranks) +
                       " started from standby workers on their hosts (already past import jax)");
  }
  launched_ = true;
  return launched;
}

StatusOr<LaunchedProcess> SshLauncher::StartAgent(const ProcessSpec& spec,
                                                  const std::string& header, pid_t pgid,
                                                  int* input) {
  const std::string& target = options_.targets[spec.ranks.front()];
  int in[2];
  if (pipe2(in, O_CLOEXEC) != 0) return ErrnoError("pipe2", errno);
  std::vector<std::string> argv = options_.ssh;
  argv.insert(argv.end(), kSshOptions.begin(), kSshOptions.end());
  argv.insert(argv.end(), {"--", target, AgentCommand(spec.argv.front(), target)});
  auto spawned = SpawnWithOutputPipe(
      {.argv = argv, .process_group = pgid, .search_path = true, .stdin_fd = in[0]});
  close(in[0]);
  if (!spawned.ok()) {
    close(in[1]);
    return UnavailableError("cannot start '" + options_.ssh.front() + "' for rank " +
                            std::to_string(spec.ranks.front()) + " on " + target + ": " +
                            spawned.status().message());
  }
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, spawned->pid, 0));
  if (pidfd < 0) {
    int err = errno;
    close(in[1]);
    kill(spawned->pid, SIGKILL);
    WaitForExit(spawned->pid);
    close(spawned->output_fd);
    return ErrnoError("pidfd_open", err);
  }
  fcntl(pidfd, F_SETFD, FD_CLOEXEC);
  fcntl(spawned->output_fd, F_SETFL, fcntl(spawned->output_fd, F_GETFL) | O_NONBLOCK);
  // Blocking: the header fits the pipe's buffer (64 KiB) unless the environment (or a shipped
  // preload) is large, and then waits for ssh to connect and read it.
  std::string_view rest = header;
  while (!rest.empty()) {
    ssize_t n = WriteNoSigpipe(in[1], rest);
    if (n <= 0) break;  // ssh has already exited; its exit says why
    rest.remove_prefix(static_cast<size_t>(n));
  }
  fcntl(in[1], F_SETFL, fcntl(in[1], F_GETFL) | O_NONBLOCK);
  *input = in[1];
  return LaunchedProcess{spec.ranks, spawned->pid, pidfd, spawned->output_fd};
}

Status SshLauncher::PrepareNext(const std::vector<ProcessSpec>& specs) {
  if (!options_.warm || !standbys_.empty() || Interrupted()) return OkStatus();
  // Read once for every spec: they name one file.
  std::optional<std::string> preload;
  const std::map<std::string, std::string> first_env = specs.front().Env();
  if (auto path = first_env.find(kPreloadFileEnv); path != first_env.end()) {
    auto bytes = ReadPreloadFile(path->second, kMaxPreloadBytes);
    if (bytes.ok()) {
      preload = Base64(*bytes);
    } else {
      notes_.push_back("the standby workers do not preload the training function (" +
                       bytes.status().message() + ")");
    }
  }
  const nlohmann::json forwarded = ForwardedEnvironment();
  for (const auto& spec : specs) {
    if (spec.ranks.size() != 1 || spec.ranks.front() < 0 ||
        static_cast<size_t>(spec.ranks.front()) >= options_.targets.size()) {
      EndStandbys();
      return InvalidArgumentError("the ssh launcher starts one process per rank");
    }
    const std::string& target = options_.targets[spec.ranks.front()];
    nlohmann::json env = AgentEnvironment(spec, forwarded);
    for (const char* name : kActivationEnv) env.erase(name);  // they come with the activation
    nlohmann::json header = {{"argv", spec.argv},
                             {"env", env},
                             {"unset", spec.unset_env},
                             {"cwd", spec.cwd},
                             {"standby", true}};
    if (preload) header["preload"] = *preload;
    int input = -1;
    auto started = StartAgent(
        spec, header.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n",
        standby_pgid_, &input);
    if (!started.ok()) {
      EndStandbys();
      return started.status();
    }
    if (standby_pgid_ == 0) standby_pgid_ = started->pid;
    standbys_.push_back({StandbyKey(spec) + "\n" + target, *started, input});
  }
  return OkStatus();
}

std::vector<std::optional<SshLauncher::Standby>> SshLauncher::TakeStandbys(
    const std::vector<ProcessSpec>& specs) {
  std::vector<std::optional<Standby>> slots(specs.size());
  if (standbys_.empty()) return slots;
  bool same = standbys_.size() == specs.size();
  for (size_t i = 0; same && i < specs.size(); ++i) {
    same =
        standbys_[i].key == StandbyKey(specs[i]) + "\n" + options_.targets[specs[i].ranks.front()];
  }
  if (!same) {
    notes_.push_back("the standby workers were started for another placement; starting afresh");
    EndStandbys();
    return slots;
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    Standby& standby = standbys_[i];
    if (std::optional<ExitStatus> exit = TryReap(standby.process.pid)) {
      const std::string& target = options_.targets[specs[i].ranks.front()];
      notes_.push_back("the standby worker of rank " + RanksText(specs[i].ranks) + " on " + target +
                       " is gone (its ssh " + exit->ToString() + "); starting it afresh");
      close(standby.input);
      close(standby.process.pidfd);
      close(standby.process.output_fd);
      continue;
    }
    slots[i] = std::move(standby);
  }
  standbys_.clear();
  return slots;
}

void SshLauncher::EndStandbys() {
  // Their agents see their stdin end and end their standbys; SIGKILL ends the local ssh at once.
  for (auto& standby : standbys_) close(standby.input);
  if (standby_pgid_ > 0) killpg(standby_pgid_, SIGKILL);
  for (auto& standby : standbys_) {
    WaitForExit(standby.process.pid);
    close(standby.process.pidfd);
    close(standby.process.output_fd);
  }
  standbys_.clear();
  standby_pgid_ = 0;
}

void SshLauncher::EndRun(bool) { EndStandbys(); }

std::vector<pid_t> SshLauncher::standby_pids() const {
  std::vector<pid_t> pids;
  for (const auto& standby : standbys_) pids.push_back(standby.process.pid);
  return pids;
}

std::vector<std::string> SshLauncher::TakeNotes() { return std::exchange(notes_, {}); }

std::vector<std::string> SshLauncher::TakeDetails() { return std::exchange(details_, {}); }

StatusOr<std::vector<std::string>> SshLauncher::UnreachableHosts(
    const std::vector<std::string>& hosts, Duration wait, int cancel_fd) {
  std::map<std::string, HostCheck> checks;
  for (const auto& h : hosts) checks.emplace(h, HostCheck{});
  const auto give_up = std::chrono::steady_clock::now() + wait;
  Duration retry = options_.first_retry;
  std::vector<std::string> down;
  for (;;) {
    bool reachable_later = false;
    // A silent host costs what is left of `wait`, not ssh's ConnectTimeout; once (`wait` zero:
    // the capacity monitor, off the loop) it gets the whole probe_timeout.
    const Duration left = give_up - std::chrono::steady_clock::now();
    const Duration timeout =
        wait <= Duration::zero()
            ? options_.probe_timeout
            : std::min<Duration>(options_.probe_timeout, std::max<Duration>(left, kShortestProbe));
    Status probed = Probe(checks, cancel_fd, &reachable_later, &down, timeout);
    if (probed.code() == StatusCode::kCancelled) return probed;
    const auto now = std::chrono::steady_clock::now();
    if (down.empty() || now >= give_up) return down;
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::min<Duration>(retry, give_up - now))
                        .count();
    pollfd fds[] = {{interrupt_fd_, POLLIN, 0}, {cancel_fd, POLLIN, 0}};  // -1s are ignored
    if (poll(fds, 2, static_cast<int>(ms)) > 0) {
      return CancelledError("the run is being stopped: the hosts were not probed to the end");
    }
    retry = std::min<Duration>(retry * 2, options_.max_retry);
    checks.clear();
    for (const auto& h : down) checks.emplace(h, HostCheck{});
  }
}

Status SshLauncher::UsePlan(const placement::Plan& plan) {
  options_.targets.clear();
  for (const auto& w : plan.workers) options_.targets.push_back(w.host);
  return OkStatus();
}

Status SshLauncher::SignalGroup(int signal) {
  // The agent reads the signal's name without "SIG" (glibc's sigabbrev_np is newer than the
  // oldest glibc the wheels run on, so the signals the controller sends are spelled here).
  std::string name;
  switch (signal) {
    case SIGTERM: name = "TERM"; break;
    case SIGKILL: name = "KILL"; break;
    case SIGINT: name = "INT"; break;
    case SIGHUP: name = "HUP"; break;
    case SIGQUIT: name = "QUIT"; break;
    case SIGUSR1: name = "USR1"; break;
    case SIGUSR2: name = "USR2"; break;
    default: name = SignalName(signal); name = name.rfind("SIG", 0) == 0 ? name.substr(3) : "";
  }
  if (!name.empty()) {
    const std::string word = name + "\n";
    for (int fd : inputs_) {
      // Non-blocking: an agent that cannot keep up (its host is gone) is killed below or by the
      // controller's SIGKILL after the grace period.
      (void)WriteNoSigpipe(fd, word);
    }
  }
  if (signal == SIGKILL && pgid_ > 0) return SignalProcessGroup(pgid_, SIGKILL);
  if (!stop_signal_) stop_signal_ = signal;
  EndCutOff();
  return OkStatus();
}

// Kills the ssh processes to the hosts found cut off, whose workers cannot hear the stop's signal:
// the agents on the other side end them once they see their stdin close.
void SshLauncher::EndCutOff() {
  for (auto it = running_.begin(); it != running_.end();) {
    if (!cut_off_.count(it->second)) {
      ++it;
      continue;
    }
    kill(it->first, SIGKILL);  // not reaped yet, so still this launcher's child
    notes_.push_back("the ssh of pid " + std::to_string(it->first) + " to " + it->second +
                     " was ended at once: " + cut_off_[it->second] +
                     " (it is cut off), so its worker cannot hear " + SignalName(stop_signal_));
    it = running_.erase(it);
  }
}

void SshLauncher::Unreachable(pid_t pid) {
  auto it = running_.find(pid);
  if (it == running_.end()) return;
  cut_off_.emplace(it->second, "a rank's control connection from that host timed out");
  if (stop_signal_) EndCutOff();  // the stop has begun: not after its grace period
}

void SshLauncher::Exited(pid_t pid, const ExitStatus& status) {
  auto it = running_.find(pid);
  if (it == running_.end()) return;
  if (status.exit_code == kSshFailed) {
    cut_off_.emplace(it->second, "another ssh to that host exited with status 255");
  }
  running_.erase(it);
}

}  // namespace jaxtrain::launch
