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

#include "base/strings.h"
#include "launch/process.h"

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
if h.get("secret"):
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
  return placement::PlanOnHosts(config, hosts, inherited, simulate);
}

std::vector<std::string> SshCommand(const accelerators::HostView& env) {
  std::vector<std::string> out;
  for (auto& w : Split(env.GetEnv(kSshCommandEnv).value_or(""), ' ')) {
    if (!w.empty()) out.push_back(w);
  }
  if (out.empty()) out.push_back("ssh");
  return out;
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

Status SshLauncher::Probe(const std::vector<ProcessSpec>& specs, bool* reachable_later) {
  *reachable_later = false;
  bool only_unreachable = true;
  struct Probing {
    std::string target;
    Spawned p;
    std::string output;
    bool open = true;
  };
  std::map<std::string, const ProcessSpec*> hosts;
  for (const auto& spec : specs) hosts.emplace(options_.targets[spec.ranks.front()], &spec);
  std::vector<Probing> probes;
  Status error;
  for (const auto& [target, spec] : hosts) {
    std::string command =
        "test -x " + ShellQuote(spec->argv.front()) + " || exit " + std::to_string(kProbeNoPython);
    if (!spec->cwd.empty()) {
      command += "; cd " + ShellQuote(spec->cwd) + " || exit " + std::to_string(kProbeNoCwd);
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
  const auto deadline = std::chrono::steady_clock::now() + options_.probe_timeout;
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
    poll(fds.data(), fds.size(), static_cast<int>(left.count()));
    if (fds.back().revents != 0) {
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
      continue;
    }
    ExitStatus exit = WaitForExit(p.p.pid);
    if (exit.ok()) continue;
    if (exit.exit_code != kSshFailed || !MayComeBack(p.output)) only_unreachable = false;
    if (!error.ok()) continue;
    const ProcessSpec& spec = *hosts.at(p.target);
    if (exit.exit_code == kProbeNoPython) {
      error = UnavailableError("host " + p.target + " has no executable " + spec.argv.front() +
                               ": the workers run the driver's Python at the same path on every "
                               "host; install the same environment there");
    } else if (exit.exit_code == kProbeNoCwd) {
      error = UnavailableError("host " + p.target + " has no directory " + spec.cwd +
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
        std::to_string(
            std::chrono::duration_cast<std::chrono::seconds>(options_.probe_timeout).count()) +
        " s from host " + names + "; check that it is up and reachable from this host");
  }
  return OkStatus();
}

Status SshLauncher::WaitForHosts(const std::vector<ProcessSpec>& specs, Status failed) {
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
    failed = Probe(specs, &reachable_later);
    if (failed.ok()) {
      Say("the hosts answer again after " + seconds(std::chrono::steady_clock::now() - start) +
          " s; starting the workers");
    }
  }
  return failed;
}

StatusOr<std::vector<LaunchedProcess>> SshLauncher::Launch(const std::vector<ProcessSpec>& specs) {
  CloseInputs();
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
  bool reachable_later = false;
  Status probed = Probe(specs, &reachable_later);
  if (!probed.ok() && reachable_later && launched_ && options_.host_wait > Duration::zero()) {
    probed = WaitForHosts(specs, std::move(probed));
  }
  JT_RETURN_IF_ERROR(probed);

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

  std::vector<LaunchedProcess> launched;
  auto fail = [&](Status s) -> Status {
    if (pgid_ > 0) killpg(pgid_, SIGKILL);
    for (auto& l : launched) {
      WaitForExit(l.pid);
      close(l.pidfd);
      close(l.output_fd);
    }
    CloseInputs();
    pgid_ = 0;
    return s;
  };
  for (const auto& spec : specs) {
    const std::string& target = options_.targets[spec.ranks.front()];
    nlohmann::json env = forwarded;
    for (const auto& name : spec.unset_env) env.erase(name);
    for (const auto& [k, v] : spec.Env()) env[k] = v;
    const std::string header = nlohmann::json{{"argv", spec.argv},
                                              {"env", env},
                                              {"unset", spec.unset_env},
                                              {"cwd", spec.cwd},
                                              {"secret", spec.secret}}
                                   .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
                               "\n";
    int in[2];
    if (pipe2(in, O_CLOEXEC) != 0) return fail(ErrnoError("pipe2", errno));
    std::vector<std::string> argv = options_.ssh;
    argv.insert(argv.end(), kSshOptions.begin(), kSshOptions.end());
    argv.insert(argv.end(), {"--", target, AgentCommand(spec.argv.front(), target)});
    auto spawned = SpawnWithOutputPipe(
        {.argv = argv, .process_group = pgid_, .search_path = true, .stdin_fd = in[0]});
    close(in[0]);
    if (!spawned.ok()) {
      close(in[1]);
      return fail(UnavailableError("cannot start '" + options_.ssh.front() + "' for rank " +
                                   std::to_string(spec.ranks.front()) + " on " + target + ": " +
                                   spawned.status().message()));
    }
    if (pgid_ == 0) pgid_ = spawned->pid;
    inputs_.push_back(in[1]);
    int pidfd = static_cast<int>(syscall(SYS_pidfd_open, spawned->pid, 0));
    if (pidfd < 0) {
      int err = errno;
      close(spawned->output_fd);
      launched.push_back({spec.ranks, spawned->pid, -1, -1});
      return fail(ErrnoError("pidfd_open", err));
    }
    fcntl(pidfd, F_SETFD, FD_CLOEXEC);
    fcntl(spawned->output_fd, F_SETFL, fcntl(spawned->output_fd, F_GETFL) | O_NONBLOCK);
    launched.push_back({spec.ranks, spawned->pid, pidfd, spawned->output_fd});
    // Blocking: the header fits the pipe's buffer (64 KiB) unless the environment is huge, and
    // then waits for ssh to connect and read it.
    std::string_view rest = header;
    while (!rest.empty()) {
      ssize_t n = WriteNoSigpipe(in[1], rest);
      if (n <= 0) break;  // ssh has already exited; its exit says why
      rest.remove_prefix(static_cast<size_t>(n));
    }
    fcntl(in[1], F_SETFL, fcntl(in[1], F_GETFL) | O_NONBLOCK);
  }
  launched_ = true;
  return launched;
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
  return OkStatus();
}

}  // namespace jaxtrain::launch
