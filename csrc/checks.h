// Argument-check macros: every check throws a built-in Python exception whose
// message carries the offending value, so callers see ValueError/TypeError/...
#pragma once

#include <pybind11/pybind11.h>

#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

namespace fastpipe {

namespace detail {

// Numbers are formatted with the C library, not iostreams: where a toolchain
// links part of libstdc++ statically into the extension (devtoolset-style
// libstdc++_nonshared.a), an ostream in here can look its numeric facet up in
// a locale made by the process's shared libstdc++, whose facet ids differ,
// and call into the wrong facet (seen as a segfault formatting a double on a
// GPU machine's build). snprintf has no such state.
template <typename T>
void append_part(std::string& out, const T& part) {
  if constexpr (std::is_same_v<T, bool>) {
    out += part ? "true" : "false";
  } else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    out += std::to_string(static_cast<long long>(part));
  } else if constexpr (std::is_integral_v<T>) {
    out += std::to_string(static_cast<unsigned long long>(part));
  } else if constexpr (std::is_floating_point_v<T>) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", static_cast<double>(part));
    out += buf;
  } else {
    out += std::string_view(part);  // strings and string literals
  }
}

}  // namespace detail

// Builds a message from parts (strings and numbers): fp_msg("lane ", lane, " out of range").
template <typename... Parts>
std::string fp_msg(const Parts&... parts) {
  std::string out;
  (detail::append_part(out, parts), ...);
  return out;
}

}  // namespace fastpipe

#define FP_CHECK_VALUE(cond, ...)                                  \
  do {                                                             \
    if (!(cond)) throw pybind11::value_error(::fastpipe::fp_msg(__VA_ARGS__)); \
  } while (0)

#define FP_CHECK_TYPE(cond, ...)                                   \
  do {                                                             \
    if (!(cond)) throw pybind11::type_error(::fastpipe::fp_msg(__VA_ARGS__)); \
  } while (0)

#define FP_CHECK_INDEX(cond, ...)                                  \
  do {                                                             \
    if (!(cond)) throw pybind11::index_error(::fastpipe::fp_msg(__VA_ARGS__)); \
  } while (0)

#define FP_CHECK_STATE(cond, ...)                                  \
  do {                                                             \
    if (!(cond)) throw std::runtime_error(::fastpipe::fp_msg(__VA_ARGS__)); \
  } while (0)
