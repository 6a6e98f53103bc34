// Argument checks shared by scatter and gather: dense layout and out=
// tensors that must not share memory with what is read.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace dpcore {

// Raises unless `tensor` is dense (strided): scatter and gather split and
// join along a dimension, which sparse and other layouts do not offer.
// `what` names the argument and index ("tensors[1]", "'out'").
void check_dense(const at::Tensor& tensor, const char* op, const std::string& what);

// Raises when some element of `out` refers to one memory location as another
// (an expanded tensor): the copies into it would race.
void check_no_internal_overlap(const at::Tensor& out, const char* op, const std::string& what);

// Raises when `written` and `read` share memory, fully or partly, as
// torch.cat(out=) refuses (at::get_overlap_status): writing one part of the
// result would change values that are read later. `written` is named
// `written_name`, `read` `read_name` in the message.
//
// Returns whether they may still share memory: overlap could not be ruled
// out cheaply (one is a non-dense view, at::get_overlap_status says TooHard)
// and their byte ranges in one storage intersect. The caller then reads
// from a copy of `read`, so that the result is right either way (torch lets
// such calls through and may compute wrong values).
bool check_no_overlap(
    const at::Tensor& written, const std::string& written_name, const at::Tensor& read,
    const std::string& read_name, const char* op);

} // namespace dpcore
