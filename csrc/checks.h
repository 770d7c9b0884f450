// Argument-check macros: every check throws a built-in Python exception whose
// message carries the offending value, so callers see ValueError/TypeError/...
#pragma once

#include <pybind11/pybind11.h>

#include <sstream>
#include <string>

namespace fastpipe {

// Builds a message from stream-able parts: fp_msg("lane ", lane, " out of range").
template <typename... Parts>
std::string fp_msg(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
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
