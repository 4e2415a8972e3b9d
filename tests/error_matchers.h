// Assertions on thrown errors and their messages, shared by the bad-input tests.
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

namespace quantmla::testing {

// Runs `action`, which must throw `Expected`, and returns the message.
template <typename Expected, typename Action>
std::string error_message(Action&& action) {
  try {
    action();
  } catch (const Expected& error) {
    return error.what();
  }
  ADD_FAILURE() << "no exception thrown";
  return "";
}

inline void expect_contains(const std::string& message, std::initializer_list<std::string> parts) {
  for (const std::string& part : parts) {
    EXPECT_NE(message.find(part), std::string::npos)
        << "message \"" << message << "\" lacks \"" << part << "\"";
  }
}

}  // namespace quantmla::testing
