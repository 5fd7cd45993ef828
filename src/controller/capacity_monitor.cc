#include "controller/capacity_monitor.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace jaxtrain::controller {

std::vector<std::string> HostsBack(const std::vector<std::string>& watched,
                                   const std::vector<std::string>& unreachable) {
  std::vector<std::string> back;
  for (const auto& h : watched) {
    if (std::find(unreachable.begin(), unreachable.end(), h) == unreachable.end()) {
      back.push_back(h);
    }
  }
  return back;
}

StatusOr<std::unique_ptr<CapacityMonitor>> CapacityMonitor::Create(launch::Launcher& launcher,
                                                                   Duration interval) {
  JT_ASSIGN_OR_RETURN(auto found, Mailbox<CapacityChange>::Create("capacity monitor"));
  const int cancel_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (cancel_fd < 0) return ErrnoError("cannot create the capacity monitor's eventfd", errno);
  return std::unique_ptr<CapacityMonitor>(
      new CapacityMonitor(launcher, interval, cancel_fd, std::move(found)));
}

CapacityMonitor::~CapacityMonitor() {
  Stop();
  close(cancel_fd_);
}

void CapacityMonitor::Start(std::vector<std::string> missing, std::vector<std::string> present) {
  Stop();
  if (missing.empty() && present.empty()) return;
  thread_ =
      std::thread([this, missing = std::move(missing), present = std::move(present)]() mutable {
        Watch(std::move(missing), std::move(present));
      });
}

void CapacityMonitor::Stop() {
  if (thread_.joinable()) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(cancel_fd_, &one, sizeof(one));
    thread_.join();
    uint64_t count;
    n = read(cancel_fd_, &count, sizeof(count));  // ready for the next watch
  }
  found_->Take();
}

void CapacityMonitor::Watch(std::vector<std::string> missing, std::vector<std::string> present) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(interval_).count();
  for (;;) {
    pollfd p{cancel_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(ms)) != 0) return;  // Stop(), or poll failed
    CapacityChange change;
    if (!present.empty()) {
      StatusOr<std::vector<std::string>> leaving = launcher_.LeavingHosts(present, cancel_fd_);
      if (!leaving.ok()) return;  // cancelled: Stop() or the run's Interrupt()
      change.leaving = std::move(*leaving);
    }
    if (!missing.empty()) {
      StatusOr<std::vector<std::string>> unreachable =
          launcher_.UnreachableHosts(missing, Duration::zero(), cancel_fd_);
      if (!unreachable.ok()) return;
      change.back = HostsBack(missing, *unreachable);
    }
    if (!change.back.empty() || !change.leaving.empty()) {
      found_->Post(std::move(change));
      return;
    }
  }
}

}  // namespace jaxtrain::controller
