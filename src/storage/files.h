// Local-filesystem primitives with the durability the run directory relies on.
// Thread-safe (no shared state).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

namespace jaxtrain::storage {

// Errors of the functions below that write, by errno (base/status.h's ErrnoCode):
// kPermissionDenied (EACCES, EPERM, EROFS), kFailedPrecondition (ENOTDIR, EISDIR, EEXIST),
// kNotFound (ENOENT), kResourceExhausted (ENOSPC, EDQUOT: the disk or quota is full; space may be
// freed), kUnavailable (EIO), kInternal (anything else). Each message names the path and the
// reason. The controller retries kResourceExhausted and kUnavailable a few times
// (controller/failure_policy.h) and fails the run at once on the others.

// "<what> '<path>': <errno's text>" with ErrnoCode(err).
Status PathError(std::string_view what, const std::string& path, int err);

// Writes all of `data` to `fd`, the open file `path` (base/fd_io.h's WriteAll, the error naming
// `path`).
Status WriteFd(int fd, std::string_view data, const std::string& path);

// mkdir -p; each directory it creates is made durable (its parent is fsynced).
// Errors: as above; kFailedPrecondition also when a file is in the way.
Status MakeDirs(const std::string& path);

// Replaces `path` with `contents` so that a reader sees the old or the new file, never a mix:
// write a temporary beside it, fsync, rename over, fsync the directory. On error the old file is
// in place (or, when only the directory's fsync failed, the new one may not survive a crash).
Status WriteFileAtomically(const std::string& path, std::string_view contents);

// Appends and flushes (no fsync: used for logs and metrics lines, which may lose their tail on a
// machine crash, never their order). On error the file is cut back to its length before the
// call, so that a failed append never leaves a torn line for the next one to continue.
Status AppendToFile(const std::string& path, std::string_view contents);

// Cuts `path` to `size` bytes (undoes appends).
Status TruncateFile(const std::string& path, uint64_t size);

// The size of `path`; 0 when it does not exist.
uint64_t FileSize(const std::string& path);

// The whole file. Errors: kNotFound, kInternal.
StatusOr<std::string> ReadFile(const std::string& path);

// The last `max_bytes` of a file (or all of it), starting at a line boundary where possible.
std::string TailOfFile(const std::string& path, size_t max_bytes);

std::string JoinPath(std::string_view a, std::string_view b);

}  // namespace jaxtrain::storage
