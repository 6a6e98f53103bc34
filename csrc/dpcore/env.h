// Settings read from the environment (DPCORE_HOST_CACHE_MB and the like).
#pragma once

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace dpcore {

// The integer value of environment variable `name`, or `fallback` when it is
// unset or empty; an error naming the variable when it is set to anything but
// an integer of at least `minimum`.
inline int64_t env_int(const char* name, int64_t fallback, int64_t minimum) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') {
    return fallback;
  }
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  TORCH_CHECK(
      errno == 0 && *end == '\0' && value >= minimum, "dpcore: expected the environment variable ", name,
      " to be an integer of at least ", minimum, ", but it is '", text, "'");
  return static_cast<int64_t>(value);
}

// Whether environment variable `name` is "1" (true) or "0" (false); `fallback`
// when it is unset or empty; an error naming the variable for anything else.
inline bool env_flag(const char* name, bool fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') {
    return fallback;
  }
  TORCH_CHECK_VALUE(
      std::strcmp(text, "0") == 0 || std::strcmp(text, "1") == 0,
      "dpcore: expected the environment variable ", name, " to be 0 or 1, but it is '", text, "'");
  return text[0] == '1';
}

} // namespace dpcore
