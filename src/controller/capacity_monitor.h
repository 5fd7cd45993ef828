// CapacityMonitor: while an elastic run trains below its max (docs/elastic.md), looks every
// interval for the hosts it lacks, asking the launcher which of them it can reach now
// (Launcher::UnreachableHosts, which blocks for as long as a probe takes: ssh's connect timeout).
// The probes run on a thread of their own, so the controller's event loop never waits for them;
// the loop learns through ready_fd() that hosts came back and takes them with TakeFound().
//
//   idle ──Start(hosts)──> watching: every `interval`, probe the hosts ──some answer──> found
//   (ready_fd readable; the thread ends) ──TakeFound()──> idle
//   Stop(), or the run's Interrupt(), ends the watch at once (a probe in flight is killed).
//
// Threads: Start(), Stop(), TakeFound() and ready_fd() on the loop's thread; the launcher's
// UnreachableHosts on the monitor's.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/mailbox.h"
#include "base/status.h"
#include "launch/launcher.h"

namespace jaxtrain::controller {

// The hosts of `watched` that are not in `unreachable`, in watched's order.
std::vector<std::string> HostsBack(const std::vector<std::string>& watched,
                                   const std::vector<std::string>& unreachable);

class CapacityMonitor {
 public:
  // `launcher` outlives the monitor. Errors: kInternal when its descriptors cannot be made.
  static StatusOr<std::unique_ptr<CapacityMonitor>> Create(launch::Launcher& launcher,
                                                           Duration interval);
  ~CapacityMonitor();  // Stop()
  CapacityMonitor(const CapacityMonitor&) = delete;
  CapacityMonitor& operator=(const CapacityMonitor&) = delete;

  // Watches `hosts` (a first probe after one interval), replacing any watch in progress.
  void Start(std::vector<std::string> hosts);
  // Ends the watch and waits for its thread; a result not taken is dropped.
  void Stop();
  // Readable once hosts came back, until TakeFound().
  int ready_fd() const { return found_->fd(); }
  // The hosts that answered, once; nullopt while none did.
  std::optional<std::vector<std::string>> TakeFound() { return found_->Take(); }

 private:
  CapacityMonitor(launch::Launcher& launcher, Duration interval, int cancel_fd,
                  std::unique_ptr<Mailbox<std::vector<std::string>>> found)
      : launcher_(launcher), interval_(interval), cancel_fd_(cancel_fd), found_(std::move(found)) {}
  void Watch(std::vector<std::string> hosts);

  launch::Launcher& launcher_;
  const Duration interval_;
  const int cancel_fd_;  // an eventfd: readable once Stop() asks the thread to end
  const std::unique_ptr<Mailbox<std::vector<std::string>>> found_;
  std::thread thread_;
};

}  // namespace jaxtrain::controller
