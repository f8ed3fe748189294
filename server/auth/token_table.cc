#include "server/auth/token_table.h"

#include <openssl/evp.h>

#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/base/status_macros.h"
#include "proto/credentials/credentials.h"

namespace muonmesh::auth {
namespace {

constexpr std::size_t kMaxTokensFileBytes = 1 << 20;
constexpr absl::string_view kDigestPrefix = "sha256:";

bool IsHex(absl::string_view s) {
  for (const char c : s) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// The digest a line's second word stands for.
absl::StatusOr<std::string> DigestOf(absl::string_view word) {
  if (absl::StartsWith(word, kDigestPrefix)) {
    const absl::string_view hex = word.substr(kDigestPrefix.size());
    if (hex.size() != 64 || !IsHex(hex)) {
      return absl::InvalidArgumentError("after 'sha256:' come the 64 hex digits of the digest");
    }
    return absl::HexStringToBytes(absl::AsciiStrToLower(hex));
  }
  MUONMESH_RETURN_IF_ERROR(credentials::CheckToken(word));
  return Sha256(word);
}

}  // namespace

std::string Sha256(absl::string_view data) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  if (EVP_Digest(data.data(), data.size(), digest, &size, EVP_sha256(), nullptr) != 1) {
    return std::string();  // never matches a stored 32-byte digest
  }
  return std::string(reinterpret_cast<const char*>(digest), size);
}

absl::StatusOr<TokenTable> TokenTable::Parse(absl::string_view text, absl::string_view origin) {
  TokenTable table;
  absl::flat_hash_map<std::string, int> line_of;  // digest -> line
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    const std::vector<absl::string_view> words =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    const std::string where = absl::StrCat(origin, ":", line_number);
    if (words.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": expected 'ROLE TOKEN' or 'ROLE sha256:HEX' (", words.size(), " words)"));
    }
    const std::optional<Role> role = ParseRole(words[0]);
    if (!role.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": unknown role (the roles are viewer, submitter, worker and admin)"));
    }
    MUONMESH_ASSIGN_OR_RETURN(std::string digest, DigestOf(words[1]), where);
    if (auto [it, inserted] = line_of.emplace(digest, line_number); !inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the same token as line ", it->second,
                       " (each token has one role; an admin may do everything)"));
    }
    table.by_digest_.emplace(std::move(digest), *role);
  }
  if (table.by_digest_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(origin, ": holds no token"));
  }
  return table;
}

absl::StatusOr<TokenTable> TokenTable::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("--tokens-file ", path, ": cannot open the file"));
  }
  std::string text;
  text.resize(kMaxTokensFileBytes + 1);
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<std::size_t>(in.gcount()));
  if (text.size() > kMaxTokensFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tokens-file ", path, ": larger than ", kMaxTokensFileBytes, " bytes"));
  }
  return Parse(text, absl::StrCat("--tokens-file ", path));
}

absl::StatusOr<std::shared_ptr<TokenFile>> TokenFile::Load(
    std::string path, absl::Duration check_every, std::function<void(const std::string&)> log) {
  std::shared_ptr<TokenFile> file(new TokenFile(std::move(path), check_every, std::move(log)));
  absl::MutexLock lock(&file->mu_);
  MUONMESH_ASSIGN_OR_RETURN(TokenTable table, TokenTable::Load(file->file_.path()));
  file->table_ = std::make_shared<const TokenTable>(std::move(table));
  return file;
}

std::shared_ptr<const TokenTable> TokenFile::Current() {
  absl::MutexLock lock(&mu_);
  // A bad version is reported once, not on every call.
  if (!file_.Changed()) return table_;
  absl::StatusOr<TokenTable> table = TokenTable::Load(file_.path());
  if (!table.ok()) {
    if (log_) {
      log_(absl::StrCat("tokens: ", file_.path(), " changed but cannot be used (",
                        table.status().message(), "); keeping the ", table_->size(),
                        " tokens in force"));
    }
    return table_;
  }
  if (log_) {
    log_(absl::StrCat("tokens: reloaded ", table->size(), " from ", file_.path(), " (",
                      table->Summary(), ")"));
  }
  table_ = std::make_shared<const TokenTable>(*std::move(table));
  return table_;
}

std::optional<Role> TokenTable::Find(absl::string_view token) const {
  const auto it = by_digest_.find(Sha256(token));
  if (it == by_digest_.end()) return std::nullopt;
  return it->second;
}

std::string TokenTable::Summary() const {
  std::vector<std::string> parts;
  for (const Role role : kAllRoles) {
    int n = 0;
    for (const auto& [digest, r] : by_digest_) n += r == role ? 1 : 0;
    parts.push_back(absl::StrCat(RoleName(role), " ", n));
  }
  return absl::StrJoin(parts, ", ");
}

}  // namespace muonmesh::auth
