// Reads YAML documents into a Document with yaml-cpp's event parser, with
// every limit enforced while it reads. Internal to proto/io: callers use
// message_file.h.
//
// yaml-cpp's scanner cannot hand over a token while the first one it holds
// is a potential simple key it has not yet confirmed or ruled out. Such a
// key stays open to the next line break outside flow collections (or the
// ':' after it), so yaml-cpp reads and keeps a whole flow collection
// ([...] or {...}) or a whole line at a time, at up to ~250 bytes a byte of
// input ("[[[[..." costs two tokens, a pending key and a flow marker each),
// before any event reaches us. The node and depth limits, which count
// events, cannot see that.
//
// So the reader watches how far yaml-cpp reads ahead of the last node it
// handed over, and stops it past ReadLimits::max_yaml_lookahead non-blank
// bytes. That bounds yaml-cpp's buffer without modelling its grammar, from
// two facts of its scanner (0.7, src/scanner.cpp, scantoken.cpp):
//  - each scanning step starts at a distinct byte that is not a blank,
//    not a line break and not on a line whose first non-blank byte is '#'
//    (such a line is a comment, or the inside of a quoted or block scalar,
//    which is one token already counted; a plain scalar ends before it);
//  - a step makes at most three tokens (the token, a pending key and a
//    block mapping start) and ends at most as many block collections as
//    were started (plus those open, which yaml-cpp's own depth guard caps).
// Every token held was made by steps that started between the last node
// handed over and the last byte read, so the buffer holds at most about
// 4 * max_yaml_lookahead tokens (88 bytes each) plus the scalar text read.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "proto/io/document.h"

namespace muonmesh::protoio::internal {

// Reads the YAML document in `text` into `*doc` (which must be empty and
// built over `text`); leaves `*doc` empty if `text` holds no document.
// Returns OK, or InvalidArgument "SOURCE:LINE:COL: reason" for syntax
// errors, limits and a second document; `*lookahead_exceeded` tells the
// caller that the read-ahead bound was the reason. yaml-cpp's exceptions
// are caught; only std::bad_alloc escapes.
absl::Status ReadYaml(absl::string_view text, absl::string_view source, const ReadLimits& limits,
                      Document* doc, bool* lookahead_exceeded);

}  // namespace muonmesh::protoio::internal
