// FileSystem: the operations on the run directory that committing, listing and retiring
// checkpoints perform, behind one interface, so that tests can stop a commit at any of them
// (storage/testing/fault_injecting_filesystem.h) and check what a crash there leaves behind.
//
// The interface is narrow on purpose: it holds the steps whose order makes a commit atomic
// (create, fsync, rename, exchange, remove) and the reads of the index and manifests, one call per
// file or directory. Copying and checksumming file contents (StageDirectory, VerifyCheckpoint)
// stays on the POSIX calls directly, so the data path never pays a virtual call per chunk.
//
// LocalFileSystem() is the POSIX implementation (local disks and NFS). Thread-safety: the
// implementations hold no state that calls share, except a fake's counters (see its header).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace jaxtrain::storage {

struct FileInfo {
  enum class Kind { kFile, kDirectory, kLink, kOther };
  Kind kind = Kind::kOther;
  uint64_t size = 0;
  uint32_t mode = 0;  // permission bits
};

// Errors of every method, by errno as storage/files.h lists them (kNotFound, kPermissionDenied,
// kResourceExhausted, kUnavailable, kFailedPrecondition, kInternal), each naming the path.
class FileSystem {
 public:
  virtual ~FileSystem() = default;

  // What `path` is, without following a link there. Errors: kNotFound when nothing is there.
  virtual StatusOr<FileInfo> Stat(const std::string& path) = 0;

  // Creates one directory with `mode` (the umask applies): true when it was created, false when a
  // directory was already there. Errors: kFailedPrecondition when something else is in the way.
  virtual StatusOr<bool> MakeDir(const std::string& path, uint32_t mode) = 0;

  // mkdir -p, each new directory made durable (storage/files.h MakeDirs).
  virtual Status MakeDirs(const std::string& path) = 0;

  // Makes a file's contents, or a directory's entries, durable.
  virtual Status Fsync(const std::string& path, bool directory) = 0;

  // rename(2): atomic, replacing a file (or an empty directory) at `to`.
  virtual Status Rename(const std::string& from, const std::string& to) = 0;

  // Swaps two existing entries atomically (renameat2 RENAME_EXCHANGE).
  virtual Status Exchange(const std::string& a, const std::string& b) = 0;

  // Durably replaces a file, old or new whole for any reader (storage/files.h WriteFileAtomically).
  virtual Status WriteFileAtomically(const std::string& path, std::string_view contents) = 0;

  // The whole file. Errors: kNotFound.
  virtual StatusOr<std::string> ReadFile(const std::string& path) = 0;

  // The names in a directory (not "." or ".."), in no particular order. Errors: kNotFound.
  virtual StatusOr<std::vector<std::string>> List(const std::string& dir) = 0;

  // Removes a file or a directory tree, not following links; nothing there is not an error.
  virtual Status RemoveTree(const std::string& path) = 0;
};

// The POSIX implementation, shared by the whole process.
FileSystem& LocalFileSystem();

}  // namespace jaxtrain::storage
