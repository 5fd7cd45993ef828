// FakeConnections: the ranks' side of a control port without a network, for tests of the
// controller's state machine (ControllerSeams::open_port = connections.Opener()).
//
// The test plays the ranks: Deliver() a frame from a rank (its connection is taken to have
// completed the handshake), Disconnect() it; and reads what the controller sent to them
// (WaitForSent()). What the test posts reaches the controller's loop in the order posted,
// on the loop's thread: the port it opened (FakeControlPort) becomes ready and hands the frames
// to its delegate in OnConnsReady(), or those of one rank in Read(rank), as a real port does.
//
// Posts for an attempt whose connections the controller has closed (a new attempt began) are
// dropped, as their connections would be: post after the attempt's processes have started.
//
// Threads: the test's methods from any thread; the port's from the controller's loop.
// Must outlive the controller whose port it serves.
#pragma once

#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/mutex.h"
#include "controller/control_port.h"
#include "wire/frame.h"

namespace jaxtrain::controller {

class FakeConnections {
 public:
  // A frame the controller sent to a rank, in the attempt it was sent in.
  struct Sent {
    int attempt = 0;
    int rank = -1;
    wire::MessageType type{};
    std::string body;
  };

  FakeConnections() : ready_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}
  ~FakeConnections() { close(ready_fd_); }
  FakeConnections(const FakeConnections&) = delete;
  FakeConnections& operator=(const FakeConnections&) = delete;

  // For ControllerSeams::open_port: the port this fake serves, reporting port number 1.
  std::function<StatusOr<std::unique_ptr<ControlPort>>(std::string, ControlPort::Delegate&, int*)>
  Opener();

  // `rank` sends a frame.
  void Deliver(int rank, wire::MessageType type, std::string body) EXCLUDES(mu_) {
    Post({.rank = rank, .type = type, .body = std::move(body)});
  }
  // `rank`'s connection closes.
  // `timed_out`: as the kernel's keepalive ending it (ControlPort::Delegate::OnClosed).
  void Disconnect(int rank, bool timed_out = false) EXCLUDES(mu_) {
    Post({.rank = rank, .close = true, .timed_out = timed_out});
  }

  // Waits up to `timeout` until the controller has sent `type` to `rank` in `attempt` `nth`
  // times; the nth such frame, or nullopt.
  std::optional<Sent> WaitForSent(int attempt, int rank, wire::MessageType type,
                                  std::chrono::seconds timeout, size_t nth = 1) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    std::optional<Sent> found;
    cv_.WaitFor(mu_, timeout, [&]() REQUIRES(mu_) {
      size_t seen = 0;
      for (const Sent& s : sent_) {
        if (s.attempt == attempt && s.rank == rank && s.type == type && ++seen == nth) {
          found = s;
          return true;
        }
      }
      return false;
    });
    return found;
  }

  // Waits up to `timeout` until the controller has handled everything posted so far (a frame:
  // its delegate call has returned), so that what the test does next comes after it.
  bool WaitUntilHandled(std::chrono::seconds timeout) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return cv_.WaitFor(mu_, timeout, [&]() REQUIRES(mu_) { return handled_ == posted_; });
  }

 private:
  friend class FakeControlPort;

  struct Event {
    int rank = -1;
    wire::MessageType type{};
    std::string body;
    bool close = false;
    bool timed_out = false;
  };

  void Post(Event e) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    events_.push_back(std::move(e));
    ++posted_;
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(ready_fd_, &one, sizeof(one));
  }

  // The events posted for `rank` (all ranks: -1), in order, taken from the queue.
  std::deque<Event> Take(int rank) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    std::deque<Event> taken;
    if (rank < 0) {
      taken.swap(events_);
      uint64_t count;
      [[maybe_unused]] ssize_t n = read(ready_fd_, &count, sizeof(count));
    } else {
      std::erase_if(events_, [&](Event& e) {
        if (e.rank != rank) return false;
        taken.push_back(std::move(e));
        return true;
      });
    }
    return taken;
  }

  void Record(Sent s) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    sent_.push_back(std::move(s));
    cv_.NotifyAll();
  }

  // Events of closed connections: dropped, which counts as handled.
  void Clear() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    handled_ += events_.size();
    events_.clear();
    cv_.NotifyAll();
  }

  void MarkHandled() EXCLUDES(mu_) {
    MutexLock lock(mu_);
    ++handled_;
    cv_.NotifyAll();
  }

  const int ready_fd_;  // an eventfd: readable while events wait
  mutable Mutex mu_;
  CondVar cv_;
  std::deque<Event> events_ GUARDED_BY(mu_);
  std::vector<Sent> sent_ GUARDED_BY(mu_);
  uint64_t posted_ GUARDED_BY(mu_) = 0;
  uint64_t handled_ GUARDED_BY(mu_) = 0;
};

// The port the controller owns; all of its state is the loop's, its queue the FakeConnections'.
class FakeControlPort final : public ControlPort {
 public:
  FakeControlPort(FakeConnections& peers, Delegate& delegate)
      : peers_(peers), delegate_(delegate) {}

  void BeginAttempt(int attempt, size_t world_size) override {
    attempt_ = attempt;
    connected_.assign(world_size, false);
    peers_.Clear();
  }
  int listen_fd() const override { return -1; }
  int ready_fd() const override { return peers_.ready_fd_; }
  void OnConnsReady() override { Handle(peers_.Take(-1)); }
  void Accept() override {}
  void ExpireHandshakes() override {}
  std::optional<TimePoint> NextDeadline() override { return std::nullopt; }
  void Sweep() override {}
  bool connected(int rank) const override { return connected_[static_cast<size_t>(rank)]; }
  void Send(int rank, wire::MessageType type, std::string_view body) override {
    if (!connected(rank)) return;
    peers_.Record({.attempt = attempt_, .rank = rank, .type = type, .body = std::string(body)});
  }
  // Records the shared frame, opened, as the rank would read it.
  void SendShared(int rank, const wire::SharedFrame& shared) override {
    if (!connected(rank)) return;
    auto f = wire::OpenShared(shared);
    if (f.ok()) {
      peers_.Record({.attempt = attempt_, .rank = rank, .type = f->type, .body = f->body});
    }
  }
  void Read(int rank) override { Handle(peers_.Take(rank)); }
  void Close(int rank) override { CloseWith(rank, /*timed_out=*/false); }
  int dropped() const override { return 0; }

 private:
  void CloseWith(int rank, bool timed_out) {
    if (!connected(rank)) return;
    connected_[static_cast<size_t>(rank)] = false;
    delegate_.OnClosed(rank, timed_out);
  }
  void Handle(std::deque<FakeConnections::Event> events) {
    for (auto& e : events) {
      if (static_cast<size_t>(e.rank) < connected_.size()) {
        if (e.close) {
          CloseWith(e.rank, e.timed_out);
        } else {
          connected_[static_cast<size_t>(e.rank)] = true;  // its handshake is taken as done
          delegate_.OnFrame(e.rank, wire::FrameView{e.type, e.body});
        }
      }
      peers_.MarkHandled();
    }
  }

  FakeConnections& peers_;
  Delegate& delegate_;
  int attempt_ = 0;
  std::vector<bool> connected_;
};

inline std::function<StatusOr<std::unique_ptr<ControlPort>>(std::string, ControlPort::Delegate&,
                                                            int*)>
FakeConnections::Opener() {
  return [this](std::string, ControlPort::Delegate& delegate,
                int* port_number) -> StatusOr<std::unique_ptr<ControlPort>> {
    *port_number = 1;
    return std::unique_ptr<ControlPort>(new FakeControlPort(*this, delegate));
  };
}

}  // namespace jaxtrain::controller
