// SshLauncher: the worker group on a list of hosts, each worker started over the system's OpenSSH
// client (`ssh`), so that ~/.ssh/config, agents, jump hosts and ControlMaster settings all apply.
// Used for bare machines and for TPU VM slices driven from one host (docs/hosts.md).
//
// One ssh per rank, all in one new local process group. Each runs, on its host, a small agent in
// the worker's Python (`python -c`, kAgentSource in ssh_launcher.cc, sent as one line by
// AgentCommand so that any login shell runs it, csh and tcsh included) that reads one JSON line on
// its stdin — the worker's command, working directory, environment and the run's secret
// (ProcessSpec::secret) — and starts the worker in a new session, handing it the secret on an
// inherited pipe (JAXTRAIN_RUN_SECRET_FD) as the local launcher does. Nothing of the environment
// or the secret is put on a command line or in an environment. After that line, ssh's stdin stays
// open and carries signals ("TERM", "CONT", "KILL", one per line) to the worker's process group;
// when it ends — the driver closed it, the driver died, the ssh connection dropped
// (ServerAliveInterval) — the agent kills the worker's whole process group. When the worker exits,
// the agent kills what it left in its process group and exits with the worker's status (128 + n for
// signal n, as a shell reports it, since ssh cannot pass a signal on).
//
// Before the processes of an attempt are started, every host is probed once (in parallel, one
// deadline): ssh must connect without prompting (BatchMode) and the worker's Python and working
// directory must exist there. A failed probe fails Launch() with a message that names the host
// and quotes ssh; on a restart, a host that cannot be reached (no answer, connection timed out
// or refused, no route) is waited for first, probed again with backoff up to host_wait, each
// wait said on stderr.
//
// Warm workers (docs/warm-workers.md), with SshLauncherOptions::warm: once an attempt trains,
// PrepareNext() starts one more ssh per rank whose agent starts a standby worker (JAXTRAIN_STANDBY,
// as StandbyPool's locally: it imports jax, and the training function when the driver ships it,
// and touches no device) and waits for a second line on its stdin, the activation: the run's
// secret and kActivationEnv, written to the standby's activation pipe. A restart activates the
// standbys still alive whose keys (StandbyKey and host) are the specs', over the connections
// already open, after the usual probe of every host; it starts afresh only the ranks of a host
// whose standby is gone or that did not answer the probe at once (its standby's connection may
// not have noticed the outage yet); a note says which ranks were warm and why any was not. Standbys
// are in a process group of their own, so the running group's signals do not reach them; an agent
// whose stdin ends before the activation ends its standby and exits 0.
//
// Every ssh command line puts "--" before the host, which ParseSshHosts and the JSON host
// description have already checked (placement::CheckHostName): a host is never read as an option.
//
// Thread-safety: SshLauncher is used by the controller's event loop only. The free functions are
// thread-safe; SshHostName runs `ssh -G` and blocks for it.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "accelerators/discovery.h"
#include "base/clock.h"
#include "base/status.h"
#include "config/scaling_config.h"
#include "launch/launcher.h"
#include "placement/elastic.h"
#include "placement/hosts.h"
#include "placement/plan.h"

namespace jaxtrain::launch {

// Driver variables passed to every worker, besides those JAXTRAIN_SSH_ENV names: JAX's, XLA's
// and the accelerator runtimes' own settings. Not TPU_*: those describe one host, and placement
// computes them per rank. The rest of the environment is the host's login one. Python's
// validations on a host pass the same (_core.SSH_FORWARDED_ENV_PREFIXES).
inline constexpr std::string_view kForwardedPrefixes[] = {"JAX_", "XLA_", "LIBTPU_", "NCCL_",
                                                          "TF_CPP_"};

// ssh options that make it fit to run a worker (and the driver's validations on a host,
// python/jaxtrain/hosts/join.py, through _core.SSH_OPTIONS): never prompt, no terminal, notice a
// dead connection within about 15 s. The options of JAXTRAIN_SSH_COMMAND come before these on
// the command line, and ssh keeps the first value it reads for an option, so they override them;
// ~/.ssh/config is read after the command line and does not (docs/failure-detection.md).
inline const std::vector<std::string> kSshOptions = {"-T",
                                                     "-o",
                                                     "BatchMode=yes",
                                                     "-o",
                                                     "ConnectTimeout=10",
                                                     "-o",
                                                     "ServerAliveInterval=5",
                                                     "-o",
                                                     "ServerAliveCountMax=3"};

// Settings (docs/hosts.md).
inline constexpr char kSshHostsEnv[] = "JAXTRAIN_SSH_HOSTS";      // "h1,h2" or "h1:4,h2:4"
inline constexpr char kHostfileEnv[] = "JAXTRAIN_HOSTFILE";       // "host slots=N" per line
inline constexpr char kSshCommandEnv[] = "JAXTRAIN_SSH_COMMAND";  // default "ssh"
inline constexpr char kSshEnvEnv[] = "JAXTRAIN_SSH_ENV";  // more variables to pass, ','-separated

// One entry of a host list: where ssh connects ("node1", "user@node1", an alias of
// ~/.ssh/config) and how many workers it takes (nullopt: not said).
struct SshHost {
  std::string target;
  std::optional<int> slots;
};

// Parses a host list: JAXTRAIN_SSH_HOSTS's "h1,h2:4" (`hostfile` false), or a hostfile in the
// format of MPI and DeepSpeed (`hostfile` true): one host per line, "host slots=N" or "host",
// '#' starts a comment, blank lines are skipped.
// Errors: kInvalidArgument naming `source`, the line or entry, and what is allowed: no host, a
// host listed twice, slots that are not a whole number >= 1, an unknown key on a hostfile line, a
// host name that placement::CheckHostName refuses (one beginning with '-', or holding whitespace
// or control characters).
StatusOr<std::vector<SshHost>> ParseSshHosts(std::string_view text, const std::string& source,
                                             bool hostfile);

// The hosts of an ssh run, as placement sees them. Each host's address is the part of its target
// after any "user@". Slots are its worker capacity (for GPU runs: its GPUs 0..slots-1, as in a
// DeepSpeed hostfile); hosts without slots take an equal share of `config.num_workers()`.
placement::HostDescription SshHostDescription(const std::vector<SshHost>& hosts,
                                              const std::string& source,
                                              const config::ScalingConfig& config);

// The plan of an ssh run, over the hosts of JAXTRAIN_HOSTFILE, else JAXTRAIN_SSH_HOSTS, else the
// JSON description of JAXTRAIN_HOSTS (docs/accelerators.md), which may describe TPU slices and
// GPUs. With the simulate switch JAX runs on CPU on those hosts.
// Errors: kInvalidArgument when no hosts are given (the message says how to give them) and
// those of ParseSshHosts; kNotFound when the hostfile cannot be read; those of PlanOnHosts.
StatusOr<placement::Plan> PlanForSsh(const config::ScalingConfig& config,
                                     const accelerators::HostView& env);

// An elastic run's share of its hosts: `workers` workers on `hosts` (whole hosts of the full
// plan, placement::ChooseHosts).
struct ElasticShare {
  std::vector<std::string> hosts;
  int workers = 0;
};

// PlanForSsh, and for an elastic run (docs/elastic.md) the plan on `share` only: the hosts
// described as for the full run (their slots from max), those not in it left out, every rank's
// placement and environment computed anew for `share->workers`. Without a share, an elastic
// config's range is also checked against the hosts (placement::CheckElasticHosts).
// Errors: those of PlanForSsh and CheckElasticHosts.
StatusOr<placement::Plan> PlanForSshOn(const config::ScalingConfig& config,
                                       const accelerators::HostView& env,
                                       const std::optional<ElasticShare>& share);

// The ssh command of JAXTRAIN_SSH_COMMAND ("ssh -F conf -i key"), split at spaces; {"ssh"}.
std::vector<std::string> SshCommand(const accelerators::HostView& env);

// The host name ssh connects to for `target` after ~/.ssh/config (`ssh -G target`): what to find
// a route to. Errors: kUnavailable when ssh cannot be run or says nothing.
StatusOr<std::string> SshHostName(const std::vector<std::string>& ssh, const std::string& target);

// The address the hosts of `targets` reach this driver at: this host's address on the route to
// the first target that is not this host, as `ssh -G` names it (kListenHostEnv overrides it; the
// caller checks that first). Blocks for one `ssh -G` per target until such a host is found.
// Errors: kUnavailable, saying why and to set kListenHostEnv.
StatusOr<std::string> ListenHostForSsh(const std::vector<std::string>& ssh,
                                       const std::vector<std::string>& targets);

// `s` as one word of a shell command line (POSIX sh or csh): single-quoted.
std::string ShellQuote(std::string_view s);

// The remote command that starts the agent on a host: exec '<python>' '-c' '<program>' '<target>',
// the agent's program as base64 decoded by the worker's Python, so that the whole command is one
// line which every login shell takes, POSIX sh and bash as well as csh and tcsh.
std::string AgentCommand(const std::string& python, const std::string& target);

// Standard base64 (RFC 4648, with padding).
std::string Base64(std::string_view data);

struct SshLauncherOptions {
  std::vector<std::string> ssh = {"ssh"};  // the command and the user's options, found in PATH
  std::vector<std::string> targets;        // by rank: where it runs (SshHost::target)
  Duration probe_timeout = std::chrono::seconds(30);
  // How long a Launch() after one that started the group (a restart) waits for hosts it cannot
  // reach, probing again with backoff (FailureConfig.unreachable_host_timeout_s); zero: it fails
  // at the first probe. A first Launch() never waits: a host that is not there at the start is
  // most often a mistake to report at once.
  Duration host_wait = Duration::zero();
  // The waits between probes: `first_retry`, doubled after each probe, at most `max_retry`.
  Duration first_retry = std::chrono::seconds(5);
  Duration max_retry = std::chrono::seconds(30);
  bool warm = false;  // standby workers on the hosts for a restart (JAXTRAIN_WARM_WORKERS)
};

class SshLauncher : public Launcher {
 public:
  explicit SshLauncher(SshLauncherOptions options);
  ~SshLauncher() override;  // closes the agents' stdin: any worker still running is killed

  // Probes every host of `specs`, then starts one ssh per spec (each spec must run one rank).
  // Errors: kUnavailable naming the host when it cannot be reached over ssh (refused, down, host
  // key unknown or changed, authentication refused: ssh's words are quoted) or lacks the
  // worker's Python or working directory; kDeadlineExceeded naming the hosts that did not answer
  // the probe in time; kInvalidArgument for a spec of several ranks or of a rank without a host.
  StatusOr<std::vector<LaunchedProcess>> Launch(const std::vector<ProcessSpec>& specs) override;

  // Sends `signal` to every worker's process group through its agent. SIGKILL also kills the
  // local ssh processes, so the group ends even when a host cannot be reached; the agents then
  // see their stdin end and kill their workers. A rank whose host is cut off (another ssh to it
  // exited with status 255, ssh's own failure) cannot hear any other signal either: its local
  // ssh is killed at once instead of after the controller's grace period.
  Status SignalGroup(int signal) override;

  // Notes the host of an ssh that exited with status 255 as cut off (SignalGroup).
  void Exited(pid_t pid, const ExitStatus& status) override;
  // Notes the host of that ssh as cut off too: the controller's keepalive found it silent
  // (about 10 s) before ssh's own keepalive would end the ssh (15 s). Once the stop has begun,
  // ends the host's ssh processes at once.
  void Unreachable(pid_t pid) override;

  // Cuts a probe in progress short (its ssh processes are killed and reaped): Launch() returns
  // kCancelled, now and from then on. Thread-safe.
  void Interrupt() override;

  // With options.warm: starts a standby worker per spec on its host, unless standbys are held.
  // A spec whose environment names a JAXTRAIN_PRELOAD_FILE of this host ships the file's bytes
  // (up to kMaxPreloadBytes) for the standby to preload.
  // Errors: kUnavailable when an ssh cannot be started (the standbys started are ended).
  Status PrepareNext(const std::vector<ProcessSpec>& specs) override;
  void EndRun(bool keep) override;  // ends the standbys
  std::vector<std::string> TakeNotes() override;
  std::vector<std::string> TakeDetails() override;

  static constexpr size_t kMaxPreloadBytes = 16 << 20;

  // The local ssh processes of the standbys held (for tests).
  std::vector<pid_t> standby_pids() const;

  // Elastic runs: the hosts that ssh cannot connect to (only that ssh connects is probed; the
  // Python and directory checks are Launch()'s), probed again after first_retry, doubled up to
  // max_retry, until `wait` has passed. With a `wait`, a probe lasts no longer than what is left of
  // it, nor less than 5 s (a healthy host's login on a busy machine), so a silent host costs about
  // `wait`, not ssh's ConnectTimeout of 10 s. Thread-safe: reads only the options that UsePlan()
  // leaves alone.
  StatusOr<std::vector<std::string>> UnreachableHosts(const std::vector<std::string>& hosts,
                                                      Duration wait, int cancel_fd) override;
  // The ranks' hosts from now on are `plan`'s.
  Status UsePlan(const placement::Plan& plan) override;

 private:
  struct Standby {
    std::string key;  // StandbyKey(spec) and the host
    LaunchedProcess process;
    int input = -1;  // the write end of its agent's stdin
  };
  // Starts the ssh of `spec` in process group `pgid` (0: a new one it leads) and writes `header`
  // on its agent's stdin; *input is the write end, non-blocking afterwards.
  StatusOr<LaunchedProcess> StartAgent(const ProcessSpec& spec, const std::string& header,
                                       pid_t pgid, int* input);
  // The standbys for `specs`, slot by slot (nullopt: start that one afresh), taken from those
  // held; none when they were started for other specs (then they are ended).
  std::vector<std::optional<Standby>> TakeStandbys(const std::vector<ProcessSpec>& specs);
  void EndStandbys();

  // What a probe checks on a host: that ssh connects, and that `python` (when not empty) is an
  // executable and `cwd` (when not empty) a directory there.
  struct HostCheck {
    std::string python;
    std::string cwd;
  };
  std::map<std::string, HostCheck> ChecksOf(const std::vector<ProcessSpec>& specs) const;
  // `reachable_later` is set when the probe failed only because hosts could not be reached
  // (no answer, connection timed out or refused, no route): what waiting may mend; those hosts
  // are listed in `unreachable` when it is given. `cancel_fd` (-1: none) cuts it short as
  // Interrupt() does. A host that has not answered within `timeout` counts as unreachable.
  Status Probe(const std::map<std::string, HostCheck>& hosts, int cancel_fd, bool* reachable_later,
               std::vector<std::string>* unreachable, Duration timeout) const;
  Status Probe(const std::map<std::string, HostCheck>& hosts, int cancel_fd, bool* reachable_later,
               std::vector<std::string>* unreachable) const {
    return Probe(hosts, cancel_fd, reachable_later, unreachable, options_.probe_timeout);
  }
  // Probes again with backoff while `failed` is of a host that may come back, up to host_wait.
  Status WaitForHosts(const std::map<std::string, HostCheck>& hosts, Status failed);
  void CloseInputs();
  bool Interrupted() const;
  // Kills the ssh processes to the hosts in cut_off_ (SignalGroup, Unreachable).
  void EndCutOff();

  SshLauncherOptions options_;
  // Readable once Interrupt() was called (an eventfd; -1 when none could be made, and then a
  // probe runs to its end).
  const int interrupt_fd_;
  pid_t pgid_ = 0;
  bool launched_ = false;    // a Launch() has started the group: the next one is a restart
  std::vector<int> inputs_;  // write ends of the agents' stdin, of the last Launch()
  // The last Launch()'s ssh processes not reaped yet (pid -> host), and the hosts found cut off
  // (host -> how: an ssh there exited with status 255, or the controller found a rank silent).
  std::map<pid_t, std::string> running_;
  std::map<std::string, std::string> cut_off_;
  int stop_signal_ = 0;  // the first signal of the last Launch()'s stop; 0 before it
  std::vector<Standby> standbys_;
  pid_t standby_pgid_ = 0;
  std::vector<std::string> notes_;
  std::vector<std::string> details_;  // for TakeDetails()
};

}  // namespace jaxtrain::launch
