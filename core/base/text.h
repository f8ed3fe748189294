#pragma once

// Text helpers every reader and writer of the project shares: UTF-8 as RFC
// 3629 defines it (no overlong forms, no surrogates, nothing past
// U+10FFFF) and JSON string literals (RFC 8259). Pure functions, any thread.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace muonmesh::text {

// Length (1-4) of the well-formed UTF-8 sequence starting at s[i], or 0 if
// none starts there. Needs i < s.size().
size_t Utf8SequenceLength(std::string_view s, size_t i);

bool IsValidUtf8(std::string_view s);

// Appends the UTF-8 encoding of `code_point` (at most U+10FFFF; the caller
// has excluded surrogates where they matter).
void AppendUtf8(uint32_t code_point, std::string* out);

// Appends `s` as a JSON string literal: quotes, `"` and `\` escaped, \b \f
// \n \r \t by name, other control characters as \u00XX, every other byte
// copied (JSON text is UTF-8: the caller passes valid UTF-8).
void AppendJsonString(std::string_view s, std::string* out);

// The same, returned.
std::string JsonString(std::string_view s);

}  // namespace muonmesh::text
