// The host's copies of checkpoint parts in memory, as the controller sees them: the store that
// python/jaxtrain/worker/checkpoint_memory.py keeps on a memory filesystem when ranks hold their
// checkpoints in host memory (JAXTRAIN_CHECKPOINT_IN_MEMORY=1; docs/checkpoint-memory.md).
//
// Layout read here: <store>/rank<r>/<name>.json, one per copy, written last, holding the copy's
// "id"; a committed checkpoint's manifest names, in "copies", the id of each rank's part.
#pragma once

#include <string>

namespace jaxtrain::storage {

// Whether every part of the committed checkpoint in `checkpoint_dir` (every rank with a file or
// link in its manifest) has its copy in `store`, and the store and the directory it is in (the
// user's own, <memory dir>/jaxtrain-<uid>) are directories of this user's that no one else may
// enter (0700): the ranks of a restart on this host then read nothing of it from storage. False
// for a manifest without "copies", a part without one, a store or parent that is missing, not a
// directory, another user's or open to others, and for anything unreadable.
bool AllPartsHeldIn(const std::string& store, const std::string& checkpoint_dir);

}  // namespace jaxtrain::storage
