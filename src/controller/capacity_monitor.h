// CapacityMonitor: while an elastic run trains (docs/elastic.md), looks every interval for the
// hosts it lacks, asking the launcher which of them it can reach now (Launcher::UnreachableHosts,
// which blocks for as long as a probe takes: ssh's connect timeout), and asks which of the hosts
// it trains on the cluster takes away (Launcher::LeavingHosts: a Slurm node drained). The probes
// run on a thread of their own, so the controller's event loop never waits for them; the loop
// learns through ready_fd() that capacity changed and takes the change with TakeFound().
//
//   idle ──Start(missing, present)──> watching: every `interval`, ask about both ──a missing
//   host answers, or a present one leaves──> found (ready_fd readable; the thread ends)
//   ──TakeFound()──> idle
//   Stop(), or the run's Interrupt(), ends the watch at once (a probe in flight is killed).
//
// Threads: Start(), Stop(), TakeFound() and ready_fd() on the loop's thread; the launcher's
// UnreachableHosts and LeavingHosts on the monitor's.
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

// What the monitor found: hosts the run lacks that can be had again, and hosts it trains on
// that the cluster is taking away. At least one is not empty.
struct CapacityChange {
  std::vector<std::string> back;
  std::vector<std::string> leaving;
};

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

  // Watches `missing` for hosts that come back and `present` for hosts that leave (a first
  // probe after one interval), replacing any watch in progress. Nothing to watch: Stop().
  void Start(std::vector<std::string> missing, std::vector<std::string> present = {});
  // Ends the watch and waits for its thread; a result not taken is dropped.
  void Stop();
  // Readable once capacity changed, until TakeFound().
  int ready_fd() const { return found_->fd(); }
  // The change, once; nullopt while there is none.
  std::optional<CapacityChange> TakeFound() { return found_->Take(); }

 private:
  CapacityMonitor(launch::Launcher& launcher, Duration interval, int cancel_fd,
                  std::unique_ptr<Mailbox<CapacityChange>> found)
      : launcher_(launcher), interval_(interval), cancel_fd_(cancel_fd), found_(std::move(found)) {}
  void Watch(std::vector<std::string> missing, std::vector<std::string> present);

  launch::Launcher& launcher_;
  const Duration interval_;
  const int cancel_fd_;  // an eventfd: readable once Stop() asks the thread to end
  const std::unique_ptr<Mailbox<CapacityChange>> found_;
  std::thread thread_;
};

}  // namespace jaxtrain::controller
