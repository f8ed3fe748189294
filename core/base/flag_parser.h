#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace muonmesh {

// The command-line parser of muonmesh's binaries (muonmeshctl's commands,
// muonmesh-worker and muonmesh-coordinator).
//
// A deliberately small parser: `--name value` or `--name=value`, booleans
// take no value; a name may be written with '_' for '-' (--data_dir is
// --data-dir). Positional arguments are refused, or, given a place for
// them, taken wherever they stand among the flags (as kubectl and git take
// them), everything after `--` included. Each subcommand declares its flags
// (with dashes); errors name the offending flag, with dashes.
class FlagParser {
 public:
  explicit FlagParser(std::string program) : program_(std::move(program)) {}

  void String(std::string name, std::string value_name, std::string help, std::string* out) {
    flags_.push_back({std::move(name), std::move(value_name), std::move(help), out});
  }
  void Int(std::string name, std::string value_name, std::string help, int64_t* out) {
    flags_.push_back({std::move(name), std::move(value_name), std::move(help), out});
  }
  // Abseil's duration syntax: 10s, 500ms, 1h30m.
  void Duration(std::string name, std::string value_name, std::string help, absl::Duration* out) {
    flags_.push_back({std::move(name), std::move(value_name), std::move(help), out});
  }
  void Bool(std::string name, std::string help, bool* out) {
    flags_.push_back({std::move(name), "", std::move(help), out});
  }

  // Parses args; sets *help when --help/-h is among them (then nothing else
  // is checked). InvalidArgument naming the flag on any error. Arguments
  // that are not flags go to `positionals` in their order (an error without
  // it).
  absl::Status Parse(const std::vector<std::string>& args, bool* help,
                     std::vector<std::string>* positionals = nullptr) {
    *help = false;
    for (const std::string& a : args) {
      if (a == "--") break;
      if (a == "--help" || a == "-h") {
        *help = true;
        return absl::OkStatus();
      }
    }
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& arg = args[i];
      const bool rest = arg == "--" && positionals != nullptr;
      if (rest || !absl::StartsWith(arg, "--")) {
        if (positionals == nullptr) {
          return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
        }
        if (rest) {
          positionals->insert(positionals->end(), args.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                              args.end());
          break;
        }
        positionals->push_back(arg);
        continue;
      }
      std::string name = arg;
      std::string value;
      bool has_value = false;
      if (const size_t eq = arg.find('='); eq != std::string::npos) {
        name = arg.substr(0, eq);
        value = arg.substr(eq + 1);
        has_value = true;
      }
      std::replace(name.begin() + 2, name.end(), '_', '-');
      Flag* flag = Find(name);
      if (flag == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("unknown flag ", name));
      }
      if (std::holds_alternative<bool*>(flag->target)) {
        if (has_value) {
          return absl::InvalidArgumentError(absl::StrCat(name, " takes no value"));
        }
        *std::get<bool*>(flag->target) = true;
        flag->seen = true;
        continue;
      }
      if (!has_value) {
        // "--spec --json" is a forgotten value, not a file named "--json".
        if (i + 1 >= args.size() || absl::StartsWith(args[i + 1], "--")) {
          return absl::InvalidArgumentError(
              absl::StrCat(name, " needs a value (", name, " ", flag->value_name, ")"));
        }
        value = args[++i];
      }
      if (auto* s = std::get_if<std::string*>(&flag->target)) {
        **s = value;
      } else if (auto* n = std::get_if<int64_t*>(&flag->target)) {
        if (!absl::SimpleAtoi(value, *n)) {
          return absl::InvalidArgumentError(
              absl::StrCat(name, ": '", value, "' is not an integer"));
        }
      } else if (auto* d = std::get_if<absl::Duration*>(&flag->target)) {
        if (!absl::ParseDuration(value, *d)) {
          return absl::InvalidArgumentError(absl::StrCat(
              name, ": '", value, "' is not a duration (a number and a unit: 500ms, 10s, 2h)"));
        }
      }
      flag->seen = true;
    }
    return absl::OkStatus();
  }

  bool Seen(const std::string& name) const {
    for (const Flag& f : flags_) {
      if (f.name == name) return f.seen;
    }
    return false;
  }

  std::string Usage(const std::string& synopsis) const {
    std::string out = absl::StrCat("Usage: ", program_, " ", synopsis, "\n\nFlags:\n");
    size_t width = 0;
    for (const Flag& f : flags_) width = std::max(width, Left(f).size());
    for (const Flag& f : flags_) {
      const std::string left = Left(f);
      absl::StrAppend(&out, "  ", left, std::string(width - left.size() + 2, ' '), f.help, "\n");
    }
    absl::StrAppend(&out, "  --help", std::string(width > 4 ? width - 4 : 2, ' '),
                    "show this help\n");
    return out;
  }

 private:
  struct Flag {
    std::string name;
    std::string value_name;
    std::string help;
    std::variant<std::string*, int64_t*, absl::Duration*, bool*> target;
    bool seen = false;
  };

  static std::string Left(const Flag& f) {
    return f.value_name.empty() ? f.name : absl::StrCat(f.name, " ", f.value_name);
  }

  Flag* Find(const std::string& name) {
    for (Flag& f : flags_) {
      if (f.name == name) return &f;
    }
    return nullptr;
  }

  std::string program_;
  std::vector<Flag> flags_;
};

}  // namespace muonmesh
