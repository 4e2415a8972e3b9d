// Typed errors. Every message names the file/tensor/value involved and the numbers that disagree.
#pragma once

#include <stdexcept>
#include <string>

namespace quantmla {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A file could not be opened, read or mapped.
class IoError : public Error {
 public:
  using Error::Error;
};

// A file's content is malformed: bad JSON, lying offsets, truncated data.
class FormatError : public Error {
 public:
  using Error::Error;
};

// A tensor or buffer has the wrong shape or dtype.
class ShapeError : public Error {
 public:
  using Error::Error;
};

// A caller passed a value outside the accepted domain (token id, option, model_type).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// The CUDA runtime reported an error (the message names the call and CUDA's error string).
class CudaError : public Error {
 public:
  using Error::Error;
};

// A fixed-capacity resource (a cache) has no room left.
class CapacityError : public Error {
 public:
  using Error::Error;
};

}  // namespace quantmla
