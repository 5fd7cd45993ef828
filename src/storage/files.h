// Local-filesystem primitives with the durability the run directory relies on.
// Thread-safe (no shared state).
#pragma once

#include <string>
#include <string_view>

#include "base/status.h"

namespace jaxtrain::storage {

// mkdir -p. Errors: kPermissionDenied, kFailedPrecondition (a file is in the way), kInternal.
// Each message names the path and the reason.
Status MakeDirs(const std::string& path);

// Replaces `path` with `contents` so that a reader sees the old or the new file, never a mix:
// write a temporary beside it, fsync, rename over, fsync the directory.
Status WriteFileAtomically(const std::string& path, std::string_view contents);

// Appends and flushes (no fsync: used for logs and metrics lines, which may lose their tail on a
// machine crash, never their order).
Status AppendToFile(const std::string& path, std::string_view contents);

// The whole file. Errors: kNotFound, kInternal.
StatusOr<std::string> ReadFile(const std::string& path);

// The last `max_bytes` of a file (or all of it), starting at a line boundary where possible.
std::string TailOfFile(const std::string& path, size_t max_bytes);

std::string JoinPath(std::string_view a, std::string_view b);

}  // namespace jaxtrain::storage
