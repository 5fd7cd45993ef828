// WorkerClient: a worker process's side of the control connection.
//
// Connect() authenticates both ways (wire/handshake.h): the client refuses a controller that
// cannot prove it holds the run's secret, before reading anything else from it; every frame after
// the handshake, both ways, is sealed with the session the handshake derived (wire/frame.h), and a
// frame from the controller that does not open ends the connection (and, under
// WatchController(), the process) before any of it is used. A connection the
// controller closes before answering the hello (it drops the oldest unproven connections when a
// flood of peers fills its table, docs/wire.md) is retried with backoff until the timeout. After
// that (the registration went with the handshake's last frame): WaitStart() for the coordinator
// and the payload, then
// Report()/SendError()/SendDone(). WatchController() turns the end of the connection into the end
// of the process, so a worker never outlives its controller, and reads what the controller sends
// during training: the kCheckpointSettled notices that WaitCheckpointsSettled() waits for, the
// kCollectiveRelease that Collective() waits for, and the controller's side of a preemption
// (WatchPreemption(), docs/preemption.md).
//
// Thread-safety: the send methods and WaitCheckpointsSettled() may be called from any thread (they
// serialise on mutexes); WaitStart() must be called by one thread, before WatchController().
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "base/clock.h"
#include "base/mutex.h"
#include "base/status.h"
#include "wire/frame.h"
#include "wire/messages.h"
#include "wire/socket.h"

namespace jaxtrain::worker {

struct WorkerClientOptions {
  wire::HostPort controller;
  std::string secret;  // raw bytes
  uint32_t rank = 0;
  uint32_t attempt = 0;
  Duration timeout = std::chrono::seconds(60);  // connect, handshake
  // The local address to connect from (numeric); empty: the system's choice. The scale
  // benchmark's fake hosts each take one of 127/8, as ranks on different hosts have addresses of
  // their own.
  std::string source_address;
  // The kRegister body (JSON: docs/wire.md), sent with the handshake's proof in one write, so a
  // rank joins in one segment fewer; empty: the worker does not register (it only reports why it
  // cannot, with SendError()).
  std::string registration;
};

// The run's secret (raw bytes) where the launcher put it for this process: the inherited pipe
// JAXTRAIN_RUN_SECRET_FD (read to EOF and closed), the file JAXTRAIN_RUN_SECRET_FILE, or the
// variable JAXTRAIN_RUN_SECRET; the variables are removed. The C++ twin of the Python worker's
// _take_secret(), for workers without Python. Not thread-safe (it changes the environment).
// Errors: kInvalidArgument when none is set or the secret is not hex; kInternal when the pipe
// or file cannot be read.
StatusOr<std::string> TakeRunSecret();

// The pause before the try after `tries` connections were dropped unanswered: 10 ms, doubling, at
// most 500 ms.
Duration ConnectRetryDelay(int tries);

struct StartInfo {
  std::string json;     // the kStart body
  std::string payload;  // the kPayload body
};

class WorkerClient {
 public:
  // Errors: kUnavailable when nothing listens at the address; kDeadlineExceeded when the handshake
  // does not finish within the timeout (the controller never answered, or dropped every try);
  // kUnauthenticated when it does not prove the secret, or refuses this worker (kRefused: the
  // message carries its reason).
  static StatusOr<std::unique_ptr<WorkerClient>> Connect(const WorkerClientOptions& options);
  ~WorkerClient();

  // Blocks until the controller starts training. Errors: kUnavailable when the connection ends;
  // kUnauthenticated when a frame does not open (someone else wrote into the connection).
  StatusOr<StartInfo> WaitStart();
  // Queues one report; does not wait for the controller. Errors: kInvalidArgument when the metrics
  // are larger than the controller accepts (wire::kMaxWorkerFrameBody); kUnavailable.
  Status Report(uint64_t round, std::string_view metrics_json);
  // A report round that carries this rank's staged checkpoint (described in JSON). Errors: as
  // Report().
  Status ReportCheckpoint(uint64_t round, std::string_view checkpoint_json,
                          std::string_view metrics_json);
  // Blocks until every checkpoint reported through this client has settled: its round's commit
  // has ended, or the controller released the wait (a rank finished, so no later round can
  // complete). At most one commit is then ahead of the next checkpoint (back-pressure). Needs
  // WatchController(), which reads the notices. Errors: kUnavailable when the connection ends
  // first.
  Status WaitCheckpointsSettled();
  // One jaxtrain.collective call (barrier(), broadcast_from_rank_zero()): sends it and blocks
  // until the controller releases it, once every rank has made it; returns the release's data
  // (rank 0's for a broadcast). The caller numbers its calls 1, 2, ... and makes one at a time.
  // Needs WatchController(), which reads the release. Errors: kInvalidArgument when the data is
  // larger than wire::kMaxCollectiveData (nothing is sent); kUnavailable when the connection ends
  // first; kDataLoss when the release is malformed or not this call's.
  StatusOr<std::string> Collective(const wire::Collective& call);

  // The last frames a worker sends: each returns once the controller's host has acknowledged
  // every byte sent so far (at most 10 s), so that the process may end at once.
  // Ending with a notice unread resets the connection, and a reset drops what the controller's
  // TCP has not yet acknowledged (the controller may be busy reading other ranks). Errors: as
  // Report(); kDeadlineExceeded when the acknowledgement did not come in time.
  Status SendError(std::string_view json);
  Status SendDone(std::string_view json);

  // Starts a thread that waits for the connection to end and then ends this process with
  // `exit_code`, after a line on stderr; a negative `exit_code` only ends the waits (the rank that
  // runs in the driver's own process, local mode). Stop() disarms it.
  void WatchController(int exit_code);
  void Stop();

  // Turns this process's SIGTERM into a preemption notice: the controller is told, and answers
  // "noted" (the process goes on; the group agrees on the notice, get_preemption_info()) or
  // "stop" (the SIGTERM was the group's stop: the process then ends by SIGTERM, as without a
  // handler; also when no answer comes within 5 s). With `usr1_notice_s` >= 0, SIGUSR1 is a
  // notice too (Slurm's --signal=USR1@<s> before the time limit), with a deadline that many
  // seconds away (0: none named), and never ends the process. Needs WatchController(), which
  // reads the answers. Errors: kInternal when a handler cannot be installed.
  Status WatchPreemption(int usr1_notice_s = -1);
  // Tells the controller of a notice this host received some other way than by SIGTERM (the GCE
  // metadata server, ...): `source` names it, `deadline_ms` (UNIX ms, 0 = none) is when the host
  // goes; the controller takes the earlier of it and its grace. Its answer needs no action: the
  // process goes on either way. Errors: kInvalidArgument when `source` is empty; as Report().
  Status SendPreemptionNotice(std::string_view source, uint64_t deadline_ms);
  // One get_preemption_info() call: "" while no preemption is agreed for this call, else the
  // agreement's JSON {"sync_call", "deadline_ms", "preempted_node_to_ranks"}. Every rank's call
  // number sync_call is the first to return it; a call made while the controller's query is
  // answered but not yet agreed waits for the agreement (or the connection's end).
  std::string PreemptionCall();
  // The report() rounds this rank has made in this attempt (the answer to the query names them):
  // the highest `round` noted here or sent by Report() or ReportCheckpoint(), so that a report
  // sent late (queued behind a checkpoint) does not take the count back. Returns whether a
  // profile request waits (TakeProfileRequest()): report() learns it with the call it makes
  // anyway.
  bool NoteRound(uint64_t round) {
    uint64_t seen = rounds_.load(std::memory_order_relaxed);
    while (seen < round && !rounds_.compare_exchange_weak(seen, round, std::memory_order_relaxed)) {
    }
    return profile_requested();
  }
  uint64_t rounds() const { return rounds_.load(std::memory_order_relaxed); }
  // Whether a profile request waits, as NoteRound() returns it (Report() notes its round).
  bool profile_requested() const { return profile_requested_.load(std::memory_order_acquire); }

  // Lets the controller's ping "stacks" (docs/wire.md) take this process's Python stacks:
  // `signal` is one on which faulthandler.register(signal, file=fd, all_threads=True) dumps every
  // thread's stack into `fd` (a memfd the caller keeps open). The watcher raises it in its own
  // thread, whose handler writes the dump there and then, whatever the training thread
  // (`thread`: its id, threading.get_ident()) is doing, blocked inside XLA with the GIL held or
  // not; and answers with the dump and what this client knows: the collective call it waits in,
  // and whether it waits for a checkpoint's commit. Call before WatchController().
  void EnableStacks(int fd, int signal, uint64_t thread);
  // The controller's last request to trace steps with jax.profiler (a ping "profile <JSON>",
  // docs/wire.md), taken once: its JSON {"dir", "steps"}; "" when none came since the last call.
  // Call it when NoteRound() says one waits.
  std::string TakeProfileRequest();

 private:
  explicit WorkerClient(int fd) : fd_(fd), decoder_(wire::kMaxControllerFrameBody) {}
  // One connection and handshake. Errors: as Connect(), and kAborted when the controller closed
  // the connection before answering the hello (the caller tries again).
  static StatusOr<std::unique_ptr<WorkerClient>> TryConnect(const WorkerClientOptions& o,
                                                            TimePoint deadline);
  Status Send(wire::MessageType type, std::string_view body);
  // Sends a last frame and waits until all that was sent is acknowledged (SendDone()).
  Status SendLast(wire::MessageType type, std::string_view body);
  StatusOr<wire::Frame> ReadFrame();
  void OnPreemptionReply(const std::string& body);
  [[noreturn]] static void EndBySigterm();
  // The body of the answer to a ping "stacks" (wire::Pong).
  std::string TakeStacks();

  int fd_;
  wire::FrameDecoder decoder_;
  // The connection's session once the handshake has proven the controller: every frame after it
  // is sealed and opened here (wire/frame.h). Sending is under send_mu_; receiving is on one
  // thread at a time (WaitStart(), then the watcher).
  wire::SealedFrames frames_;
  bool sealed_ = false;  // set before any frame is sealed or opened
  std::mutex send_mu_;
  std::string send_buffer_;  // the sealed frame being sent (send_mu_), its memory reused
  std::thread watcher_;
  bool stopping_ = false;

  Mutex settle_mu_;
  CondVar settle_cv_;
  uint64_t checkpoints_reported_ GUARDED_BY(settle_mu_) = 0;
  uint64_t checkpoints_settled_ GUARDED_BY(settle_mu_) = 0;
  bool released_ GUARDED_BY(settle_mu_) = false;
  bool lost_ GUARDED_BY(settle_mu_) = false;  // the watcher saw the connection end

  // Preemption (WatchPreemption(), PreemptionCall()), under settle_mu_ as well.
  std::thread notice_thread_;
  std::atomic<uint64_t> rounds_{0};
  uint64_t calls_ GUARDED_BY(settle_mu_) = 0;
  bool query_pending_ GUARDED_BY(settle_mu_) = false;  // answered, not yet agreed
  bool agreed_ GUARDED_BY(settle_mu_) = false;
  uint64_t sync_call_ GUARDED_BY(settle_mu_) = 0;
  std::string agreement_ GUARDED_BY(settle_mu_);
  std::string notice_reply_ GUARDED_BY(settle_mu_);   // "noted" or "stop"; "" while waiting
  std::string notice_source_ GUARDED_BY(settle_mu_);  // the signal's notice being answered
  // The last collective release the watcher read (under the same mutex as the notices).
  std::optional<StatusOr<wire::Collective>> release_ GUARDED_BY(settle_mu_);
  std::string release_body_ GUARDED_BY(settle_mu_);  // what release_'s data points into

  // The stacks (EnableStacks()); the dump is taken on the watcher's thread only.
  int stacks_fd_ = -1;
  int stacks_signal_ = 0;
  uint64_t stacks_thread_ = 0;
  // What the stacks' answer says: the collective call being waited in (its sequence number and
  // kind, 0: none), and whether WaitCheckpointsSettled() waits.
  std::atomic<uint64_t> collective_sequence_{0};
  std::atomic<uint8_t> collective_kind_{0};
  std::atomic<bool> settling_{false};
  // The profile request (TakeProfileRequest()).
  std::atomic<bool> profile_requested_{false};
  Mutex profile_mu_;
  std::string profile_request_ GUARDED_BY(profile_mu_);
};

}  // namespace jaxtrain::worker
