#include "launch/local_launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "launch/process.h"

namespace jaxtrain::launch {
namespace {

void Discard(LaunchedProcess& p) {
  kill(p.pid, SIGKILL);
  WaitForExit(p.pid);
  close(p.pidfd);
  close(p.output_fd);
}

}  // namespace

LocalLauncher::~LocalLauncher() {
  if (standbys_) standbys_->Release(this);
}

StatusOr<std::vector<LaunchedProcess>> LocalLauncher::Launch(
    const std::vector<ProcessSpec>& specs) {
  pgid_ = 0;
  std::optional<StandbyPool::Taken> taken;
  if (standbys_) {
    taken = standbys_->Take(this, specs, &notes_);
  } else if (!said_off_) {
    said_off_ = true;
    notes_.push_back(
        "warm workers are off (JAXTRAIN_WARM_WORKERS=0): every attempt starts "
        "fresh worker processes");
  }
  if (taken) pgid_ = taken->pgid;
  std::vector<LaunchedProcess> launched;
  std::vector<int> warm;
  auto fail = [&](Status s) -> Status {
    Status killed = SignalGroup(SIGKILL);
    if (!killed.ok()) s = Status(s.code(), s.message() + " (and " + killed.message() + ")");
    for (auto& p : launched) {
      waitpid(p.pid, nullptr, 0);
      close(p.pidfd);
      close(p.output_fd);
    }
    if (taken) {
      for (auto& slot : taken->slots) {
        if (!slot) continue;
        if (slot->activation_fd >= 0) close(slot->activation_fd);
        if (slot->process.pid > 0) Discard(slot->process);
      }
    }
    pgid_ = 0;
    return s;
  };

  for (size_t i = 0; i < specs.size(); ++i) {
    const ProcessSpec& spec = specs[i];
    if (taken && taken->slots[i]) {
      Standby standby = std::move(*taken->slots[i]);
      taken->slots[i].reset();
      Status activated = Activate(standby, spec);
      if (activated.ok()) {
        launched.push_back(standby.process);
        warm.insert(warm.end(), spec.ranks.begin(), spec.ranks.end());
        continue;
      }
      notes_.push_back(activated.message() + "; starting a fresh process");
      Discard(standby.process);
    }
    std::vector<std::string> env = EnvironmentEntries(LocalEnvironment(spec));
    int secret_fd = -1;
    if (!spec.secret.empty()) {
      auto fd = PipeHolding(spec.secret);
      if (!fd.ok()) {
        return fail(UnavailableError("cannot start the process of rank " + RanksText(spec.ranks) +
                                     ": " + fd.status().message()));
      }
      secret_fd = *fd;
      env.push_back(std::string(kSecretFdEnv) + "=" + std::to_string(secret_fd));
    }
    auto started = StartLocalProcess(spec, env, pgid_, secret_fd);
    if (secret_fd >= 0) close(secret_fd);
    if (!started.ok()) {
      return fail(UnavailableError("cannot start the process of rank " + RanksText(spec.ranks) +
                                   " (" + spec.argv[0] + "): " + started.status().message()));
    }
    if (pgid_ == 0) pgid_ = started->pid;
    launched.push_back(*started);
  }
  if (!warm.empty()) {
    details_.push_back("rank" + std::string(warm.size() > 1 ? "s " : " ") + RanksText(warm) +
                       " started from standby workers (already past import jax)");
  }
  return launched;
}

Status LocalLauncher::SignalGroup(int signal) {
  return pgid_ > 0 ? SignalProcessGroup(pgid_, signal) : OkStatus();
}

Status LocalLauncher::PrepareNext(const std::vector<ProcessSpec>& specs) {
  return standbys_ ? standbys_->Prepare(this, specs) : OkStatus();
}

void LocalLauncher::EndRun(bool keep) {
  if (!standbys_) return;
  if (keep) {
    standbys_->Release(this);
  } else {
    standbys_->End(this);
  }
}

std::vector<std::string> LocalLauncher::TakeNotes() { return std::exchange(notes_, {}); }

std::vector<std::string> LocalLauncher::TakeDetails() { return std::exchange(details_, {}); }

}  // namespace jaxtrain::launch
