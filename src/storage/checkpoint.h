// Checkpoints in the run directory: staging a rank's files, committing a round's checkpoint
// atomically, the index of committed checkpoints, retention, verification.
//
// A checkpoint is committed when its directory appears under its final name in the run directory,
// holding every rank's files and, written last, its manifest (MANIFEST_NAME: files, sizes, CRC-32C
// checksums, round, rank 0's metrics). It appears by one atomic rename, after every file and
// directory in it has been fsynced, so a reader sees all of it or none of it. checkpoints.json is a
// rebuildable index of the committed ones, rewritten atomically; anything under .staging/ is an
// interrupted commit and is swept at the next start.
//
// File modes and symbolic links: a file keeps its permission bits (0777 & mode, never widened
// beyond the umask, which applies when it is staged; the owner always keeps read); a directory
// keeps its mode, with rwx for the owner so that retention can delete it. A symbolic link whose
// target lies inside the checkpoint is kept as a link (its target stored relative, never copied
// twice); a link whose target lies outside it (an absolute target elsewhere, a `..` that climbs
// out, or a chain that ends outside) is refused, never followed. The manifest records each file's
// mode, each directory's ("dirs") and each kept link with its target ("links"). Private runs
// (docs/architecture.md) get 0700/0600 through the umask.
//
// Hashes: where a part is also kept as a copy outside the run directory (host memory:
// docs/checkpoint-memory.md), its files are staged with `hash`, which adds each file's SHA-256
// (storage/sha256.h: OpenSSL's, at the speed of the CPU's SHA instructions), computed in the same
// pass as its CRC-32C, to its entry and to the manifest ("sha256", hex). The CRC-32C catches
// damage; the SHA-256 is what lets a copy that storage did not just write be checked against the
// committed checkpoint, across attempts (the run's secret changes with every fit(), so a MAC could
// not serve). Without `hash` an entry has no "sha256", as in manifests written before it existed.
//
// Layout:  <run>/.staging/a<attempt>-r<index>-rank<r>/...   one rank's staged files
//          <run>/<dir_name>/...  + <run>/<dir_name>/.jaxtrain_manifest.json
//          <run>/checkpoints.json
//
// Committing, the index and reading manifests go through a FileSystem (storage/filesystem.h), the
// local one unless a test passes its own; the file contents are copied and checked with POSIX
// calls.
//
// Functions are thread-safe except that one run directory must have one writer (the controller).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "base/status.h"
#include "storage/filesystem.h"

namespace jaxtrain::storage {

inline constexpr char kManifestName[] = ".jaxtrain_manifest.json";
inline constexpr char kStagingDir[] = ".staging";

// One entry of a checkpoint: a regular file, or (with `link` set) a symbolic link.
struct FileEntry {
  std::string path;  // relative to the checkpoint directory
  uint64_t size = 0;
  uint32_t crc32c = 0;
  uint32_t mode = 0644;  // permission bits of a file as staged
  std::string link;      // a kept link's target, relative to the link's directory; "" = a file
  std::string sha256;    // a file's SHA-256, 64 lowercase hex digits; "" = not computed
  bool operator==(const FileEntry&) const = default;
};

inline constexpr size_t kSha256HexSize = 64;

// Whether `hex` is "" or a SHA-256 as FileEntry holds it (64 lowercase hex digits).
bool IsSha256HexOrEmpty(const std::string& hex);

// Copies every regular file under `src` into `dst` (created; files already there are replaced),
// streaming, computing each file's CRC-32C on the way; with `durable`, fsyncs every file and
// directory written. Without it the copy is a snapshot in the page cache, independent of `src`
// from the moment this returns, which CommitCheckpoint makes durable (report() stages that way, so
// that training waits for the copy only). Modes and links as described at the top; `src` itself
// may be a link to a directory (the user named it). Other kinds of files (sockets, FIFOs,
// devices) are skipped. Errors: kNotFound when `src` does not exist, kInvalidArgument when it is
// not a directory or holds a link that leads out of it (naming the link and its target),
// kPermissionDenied / kInternal naming the file and the reason.
StatusOr<std::vector<FileEntry>> StageDirectory(const std::string& src, const std::string& dst,
                                                bool durable = true, bool hash = false);

// A checkpoint directory read into memory (SnapshotDirectory): its directories, files (bytes and
// permission bits) and kept links, in the order StageDirectory would copy them. Move-only.
//
// A file's buffer is anonymous memory. When its snapshot is destroyed the buffer is kept, mapped
// and touched, for the process's next snapshot (SnapshotRelease): a training loop checkpoints
// files of the same sizes again and again, and reading into fresh memory costs a page fault and
// a zeroed page per 4 KiB, which is most of what a snapshot blocks training for
// (bench/checkpoint_commit.py, 256 MiB per rank, 4 ranks on 2 cores: 0.20-0.25 s for a worker's
// first snapshot, 0.10-0.17 s for the later ones). What the next snapshot does not reuse is
// unmapped when it is taken, so a process keeps at most its last snapshot's memory. Thread-safe:
// snapshots may be taken and destroyed on different threads.
struct SnapshotRelease {
  size_t bytes = 0;  // the mapping's size
  void operator()(char* p) const;
};

// The bytes of released snapshot buffers kept for the next snapshot.
uint64_t KeptSnapshotBytes();

struct DirectorySnapshot {
  enum class Kind { kDir, kFile, kLink };
  struct Item {
    Kind kind = Kind::kFile;
    std::string rel;                              // relative to the directory
    uint32_t mode = 0;                            // permission bits of the source
    std::string link;                             // kLink: the target to keep
    std::unique_ptr<char, SnapshotRelease> data;  // kFile: `size` bytes (anonymous memory)
    uint64_t size = 0;
    // kFile: the bytes' SHA-256 (hex), once a WriteSnapshot with `hash` has computed it, so that
    // writing the snapshot again (the host-memory copy after the staging copy) does not hash
    // again. One snapshot is written by one thread at a time.
    mutable std::string sha256;
  };
  DirectorySnapshot() = default;
  DirectorySnapshot(DirectorySnapshot&&) = default;
  DirectorySnapshot& operator=(DirectorySnapshot&&) = default;

  std::vector<Item> items;
  uint64_t bytes = 0;  // the files' bytes, together
};

// Reads every regular file under `src` into memory, by the rules of StageDirectory (links that
// lead out refused, other kinds skipped), so that `src` may change or go as soon as this returns;
// no checksum is computed and nothing is written. Buffers of earlier snapshots are reused where
// they are large enough (SnapshotRelease); the kept ones it does not reuse are unmapped. The files
// are listed (sizes from lstat) before any is read. Errors: kResourceExhausted, before anything is
// read, when they hold more than `budget_bytes` together (also when a file grew past it while the
// others were read, or the memory cannot be had), so that the caller can copy with StageDirectory
// instead; otherwise as StageDirectory.
StatusOr<DirectorySnapshot> SnapshotDirectory(const std::string& src, uint64_t budget_bytes);

// Writes a snapshot into `dst` (created; files already there are replaced) as StageDirectory
// with durable=false would have copied its source, computing each file's CRC-32C (and with `hash`
// its SHA-256, in the same pass, or the one an earlier write of the snapshot computed): the same
// entries, modes and links. Errors: kPermissionDenied / kInternal naming the path and the reason
// (a full disk is kInternal with the system's "No space left on device").
StatusOr<std::vector<FileEntry>> WriteSnapshot(const DirectorySnapshot& snapshot,
                                               const std::string& dst, bool hash = false);

// The entries WriteSnapshot would return for `snapshot`, computed from its memory without
// writing anything (a part uploaded from memory: python/jaxtrain/worker/checkpoint_store.py):
// each file's CRC-32C and, with `hash`, its SHA-256 (in the same pass; kept in the snapshot, so
// a later WriteSnapshot does not hash again), kept links; a file's mode is its source's with
// read for the owner (what was staged also had the umask applied, which the source's mode
// already reflects). Cannot fail.
std::vector<FileEntry> DescribeSnapshot(const DirectorySnapshot& snapshot, bool hash);

// The staging directory of one rank's files for its report `round` of `attempt` (its report
// index in that attempt, docs/wire.md: not the run's round).
std::string StagingPath(const std::string& run_dir, int attempt, uint64_t round, int rank);

struct RankCheckpoint {
  int rank = 0;
  std::string staging_dir;
  std::vector<FileEntry> files;
  // A token the rank chose for this part, naming its copies kept elsewhere (host memory:
  // python/jaxtrain/worker/checkpoint_memory.py); recorded in the manifest's "copies". "" = none.
  std::string copy_id;
  // The part's files are already in place in the run directory on object storage, uploaded
  // there by the rank's own host (python/jaxtrain/worker/checkpoint_store.py); nothing is staged
  // here (staging_dir is ""), and the commit writes only the manifest, which names them.
  bool in_store = false;
};

struct CheckpointRecord {
  std::string dir_name;
  uint64_t round = 0;
  double time = 0;
  nlohmann::json metrics;  // rank 0's metrics of the round (non-finite floats as strings)
  uint64_t bytes = 0;
  uint64_t files = 0;
};

// Whether `path` is a clean relative path: not empty, not absolute, no empty, "." or ".."
// component, no NUL.
bool IsCleanRelativePath(const std::string& path);

// Checks one rank's part as a worker described it, before anything is moved or deleted: its
// staging_dir is a real directory (not a link) directly under <run_dir>/.staging, each path is
// clean (IsCleanRelativePath), each file and its parent directories are what the entry says
// (a regular file, or a link with the recorded target, which stays inside the checkpoint), no
// component is a link, and a sha256 is "" or 64 lowercase hex digits. A part `in_store` has no
// staging_dir and nothing here to look at: its paths must be clean, its links stay inside and its
// sha256s be well formed. Errors: kInvalidArgument naming the rank, the path and what is wrong.
Status CheckStagedPart(const std::string& run_dir, const RankCheckpoint& part);

// Commits one round's checkpoint as <run_dir>/<dir_name> (replacing a directory of that name
// atomically); the manifest's "copies" lists each part's copy_id that is set, as
// {"rank": r, "id": copy_id}. Every part is checked with CheckStagedPart first; every staged file
// is fsynced before it is moved, so parts staged without `durable` are committed as durably as
// the others. A file's entry carries its "sha256" when it was staged with `hash`.
// Errors: kInvalidArgument for a dir_name that is not one plain directory name, for a part that
// CheckStagedPart refuses, for a file written by two ranks (naming both and the file) or for the
// reserved manifest name; kInternal / kPermissionDenied for filesystem failures, naming the path.
// A commit stopped at any step (an error, or a crash of the process) leaves the committed
// checkpoints as they were, or the new one whole in place when it stopped after the commit point;
// its leftovers are under .staging/ only, where the next commit of the name, or the sweep at the
// next attempt's start, removes them.
StatusOr<CheckpointRecord> CommitCheckpoint(const std::string& run_dir, const std::string& dir_name,
                                            uint64_t round, double time,
                                            const std::string& metrics_json,
                                            const std::vector<RankCheckpoint>& ranks,
                                            FileSystem& fs = LocalFileSystem());

// Whether a committed checkpoint's manifest says its files are on object storage, not beside it.
bool InStore(const nlohmann::json& manifest);

// Checks a committed checkpoint against its manifest: every file present as a regular file with
// its size, every kept link a link with its target, and with `checksums` also each file's CRC-32C,
// files read in parallel on up to `threads` threads (0: one per core, at most 8), so the time
// scales with the largest file rather than the sum. Errors: kDataLoss naming the file and what
// differs; kNotFound when the directory or its manifest is missing; kCancelled soon after `cancel`
// (when given) becomes true, checked between files and between the chunks of a file. A manifest
// whose files are in the store (InStore) is checked for its form only: each rank checks what it
// downloads of it against the manifest.
Status VerifyCheckpoint(const std::string& dir, bool checksums, int threads = 0,
                        const std::atomic<bool>* cancel = nullptr);

// The entries a manifest lists: its files (with their "sha256" where the manifest has one), then
// its kept links. nullopt when it is damaged.
std::optional<std::vector<FileEntry>> ManifestEntries(const nlohmann::json& manifest);

// Reads the manifest's record of a committed checkpoint directory.
StatusOr<CheckpointRecord> ReadCheckpointRecord(const std::string& dir,
                                                FileSystem& fs = LocalFileSystem());

// The committed checkpoints of a run, oldest first.
class CheckpointIndex {
 public:
  // Loads checkpoints.json and reconciles it with the directory: entries whose directory or
  // manifest is gone are dropped, committed directories missing from the index are added.
  // `warnings` (not null) receives a line for each change. Errors: kDataLoss for an index that
  // cannot be read or parsed. Save() writes through the same `fs`, which must outlive the index.
  static StatusOr<CheckpointIndex> Load(const std::string& run_dir,
                                        std::vector<std::string>* warnings,
                                        FileSystem& fs = LocalFileSystem());

  const std::vector<CheckpointRecord>& records() const { return records_; }
  // Adds or replaces (same dir_name) a record as the newest.
  void Add(CheckpointRecord record);
  void Remove(const std::string& dir_name);
  Status Save() const;

 private:
  std::string run_dir_;
  FileSystem* fs_ = &LocalFileSystem();
  std::vector<CheckpointRecord> records_;
};

struct RetentionPolicy {
  std::optional<int> num_to_keep;
  std::optional<std::string> score_attribute;  // a metric; nested keys joined with '/'
  bool higher_is_better = true;
};

// The checkpoints to delete: all but the best `num_to_keep` by score (or the newest, without a
// score attribute); the newest is never deleted. A checkpoint without the score counts as worst.
// The checkpoints named in `pending` (validation pending: their score may still come) are never
// deleted and take none of the `num_to_keep` places.
std::vector<std::string> SelectForDeletion(const std::vector<CheckpointRecord>& records,
                                           const RetentionPolicy& policy,
                                           const std::set<std::string>& pending = {});

// Asynchronous validation (python/jaxtrain/validation.py and driver/validator.py,
// docs/checkpoints.md). Rank 0 of a report(checkpoint=..., validation=...) writes
// <run>/validation-requests/<round>.json before it sends the report; the driver runs the
// validation once the round's checkpoint has committed and records its outcome in
// <run>/validation.json: {"checkpoints": {dir_name: {"round", "status" ("validated" or
// "failed"), "metrics", "error"}}}.
inline constexpr char kValidationName[] = "validation.json";
inline constexpr char kValidationRequestsDir[] = "validation-requests";

struct Validations {
  std::vector<CheckpointRecord> records;  // with the metrics each validation returned merged in
  std::set<std::string> pending;          // requested and not ended
};

// `records` with the outcomes of their validations: the metrics a validation returned replace
// the reported ones of the same name; a checkpoint whose round has a request and no outcome for
// that round is pending. A missing or damaged validation.json counts as no outcome.
Validations ApplyValidations(const std::string& run_dir, std::vector<CheckpointRecord> records,
                             FileSystem& fs = LocalFileSystem());

// `records` ordered best first by the policy's score (newest first without one).
std::vector<CheckpointRecord> RankByScore(std::vector<CheckpointRecord> records,
                                          const RetentionPolicy& policy);

// Applies `policy` to the run directory's committed checkpoints as the controller does after a
// commit (ApplyValidations, SelectForDeletion; the index saved before any deletion): for the
// driver once the controller has ended and the last validations have. Returns one line per
// checkpoint that could not be deleted. Errors: as CheckpointIndex::Load and Save.
StatusOr<std::vector<std::string>> ApplyRetention(const std::string& run_dir,
                                                  const RetentionPolicy& policy);

// Removes a directory tree. Errors: kInternal naming the path.
Status RemoveTree(const std::string& path);

}  // namespace jaxtrain::storage
