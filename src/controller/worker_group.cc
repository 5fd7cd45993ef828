#include "controller/worker_group.h"

#include <signal.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace jaxtrain::controller {
namespace {

constexpr size_t kReadChunk = 64 << 10;
constexpr int kMaxReadyProcs = 256;  // process events (output, exit) taken per call

// Real processes, each watched through its pidfd and output pipe in one epoll set.
class ProcessGroup final : public WorkerGroup {
 public:
  ProcessGroup(launch::Launcher& launcher, bool echo, int epoll_fd, Delegate& delegate);
  ~ProcessGroup() override;

  Status Start(const std::vector<launch::ProcessSpec>& specs) override;
  int ready_fd() const override { return epoll_fd_; }
  void OnReady() override;
  Status Signal(int signal) override;
  void Unreachable(int rank) override;
  size_t running() const override { return running_; }
  size_t outputs_open() const override { return outputs_open_; }
  size_t size() const override { return procs_.size(); }
  void CloseOutputs() override;

 private:
  struct Proc {
    launch::LaunchedProcess launched;
    bool reaped = false;
    std::unique_ptr<RankOutput> output;
  };

  Status Watch();
  void ReadOutput(Proc& p);
  void CloseOutput(Proc& p);
  void Reap(Proc& p);

  launch::Launcher& launcher_;
  const bool echo_;
  // Every process's output (data.u64: 2 x its index in procs_) and pidfd (2 x index + 1) until
  // it is closed.
  const int epoll_fd_;
  Delegate& delegate_;
  std::vector<Proc> procs_;
  size_t running_ = 0;
  size_t outputs_open_ = 0;
};

}  // namespace

StatusOr<std::unique_ptr<WorkerGroup>> WorkerGroup::Create(launch::Launcher& launcher, bool echo,
                                                           Delegate& delegate) {
  int epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd < 0) return ErrnoError("cannot create the worker group's epoll set", errno);
  return std::unique_ptr<WorkerGroup>(new ProcessGroup(launcher, echo, epoll_fd, delegate));
}

ProcessGroup::ProcessGroup(launch::Launcher& launcher, bool echo, int epoll_fd, Delegate& delegate)
    : launcher_(launcher), echo_(echo), epoll_fd_(epoll_fd), delegate_(delegate) {}

ProcessGroup::~ProcessGroup() {
  for (Proc& p : procs_) {
    if (p.launched.output_fd >= 0) close(p.launched.output_fd);
    if (p.launched.pidfd >= 0) close(p.launched.pidfd);
  }
  close(epoll_fd_);
}

Status ProcessGroup::Start(const std::vector<launch::ProcessSpec>& specs) {
  JT_ASSIGN_OR_RETURN(std::vector<launch::LaunchedProcess> launched, launcher_.Launch(specs));
  procs_.clear();
  for (auto& l : launched) {
    auto output = std::make_unique<RankOutput>(
        l.ranks, echo_, [this](int rank, std::string_view text) { delegate_.OnLog(rank, text); },
        [this](std::string_view line) { return launcher_.ParseTaskEnd(line); });
    procs_.push_back({.launched = std::move(l), .output = std::move(output)});
  }
  running_ = procs_.size();
  outputs_open_ = 0;
  for (const Proc& p : procs_) outputs_open_ += p.launched.output_fd >= 0 ? 1 : 0;
  return Watch();
}

Status ProcessGroup::Watch() {
  for (size_t i = 0; i < procs_.size(); ++i) {
    launch::LaunchedProcess& l = procs_[i].launched;
    epoll_event exit_ev{.events = EPOLLIN, .data = {.u64 = 2 * i + 1}};
    epoll_event out_ev{.events = EPOLLIN, .data = {.u64 = 2 * i}};
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, l.pidfd, &exit_ev) == 0 &&
        (l.output_fd < 0 || epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, l.output_fd, &out_ev) == 0)) {
      continue;
    }
    const int err = errno;
    (void)launcher_.SignalGroup(SIGKILL);  // the group is reaped below whether or not it took
    for (Proc& p : procs_) {
      launch::WaitForExit(p.launched.pid);
      p.reaped = true;
      CloseOutput(p);
      close(p.launched.pidfd);
      p.launched.pidfd = -1;
    }
    running_ = 0;
    return UnavailableError(std::string("cannot watch the worker processes: ") +
                            std::strerror(err));
  }
  return OkStatus();
}

void ProcessGroup::OnReady() {
  epoll_event events[kMaxReadyProcs];
  int n = epoll_wait(epoll_fd_, events, kMaxReadyProcs, 0);
  for (int i = 0; i < n; ++i) {
    if (events[i].data.u64 % 2 != 0) continue;
    Proc& p = procs_[events[i].data.u64 / 2];
    if (p.launched.output_fd >= 0) ReadOutput(p);
  }
  for (int i = 0; i < n; ++i) {
    if (events[i].data.u64 % 2 == 0) continue;
    Proc& p = procs_[events[i].data.u64 / 2];
    if (!p.reaped) Reap(p);
  }
}

void ProcessGroup::Reap(Proc& p) {
  std::optional<launch::ExitStatus> status = launch::TryReap(p.launched.pid);
  if (!status) return;
  p.reaped = true;
  --running_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, p.launched.pidfd, nullptr);
  close(p.launched.pidfd);
  p.launched.pidfd = -1;
  launcher_.Exited(p.launched.pid, *status);
  delegate_.OnExit(p.launched.ranks, *status, *p.output);
}

void ProcessGroup::ReadOutput(Proc& p) {
  char buf[kReadChunk];
  for (;;) {
    ssize_t n = read(p.launched.output_fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) return CloseOutput(p);
    std::string text = p.output->Take(std::string_view(buf, static_cast<size_t>(n)));
    if (!text.empty()) delegate_.OnConsole(std::move(text));
  }
}

void ProcessGroup::CloseOutput(Proc& p) {
  if (p.launched.output_fd < 0) return;
  std::string text = p.output->Close();
  if (!text.empty()) delegate_.OnConsole(std::move(text));
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, p.launched.output_fd, nullptr);
  --outputs_open_;
  close(p.launched.output_fd);
  p.launched.output_fd = -1;
}

void ProcessGroup::CloseOutputs() {
  for (Proc& p : procs_) CloseOutput(p);
}

void ProcessGroup::Unreachable(int rank) {
  for (const Proc& p : procs_) {
    if (p.reaped) continue;
    const std::vector<int>& ranks = p.launched.ranks;
    if (std::find(ranks.begin(), ranks.end(), rank) != ranks.end()) {
      return launcher_.Unreachable(p.launched.pid);
    }
  }
}

Status ProcessGroup::Signal(int signal) {
  if (signal == SIGTERM) {
    for (Proc& p : procs_) p.output->Stopping();
  }
  return launcher_.SignalGroup(signal);
}

}  // namespace jaxtrain::controller
