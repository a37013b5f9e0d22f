// One register function per area; module.cpp only calls them.
#pragma once

#include <pybind11/pybind11.h>

#include <string>

namespace stoker::bindings {

// `text` as a Python str, bytes that are not UTF-8 escaped (messages quote shards).
pybind11::str message_of(const std::string& text);

void register_errors(pybind11::module_& m);
void register_reader(pybind11::module_& m);
void register_ring(pybind11::module_& m);
void register_formats(pybind11::module_& m);
void register_cuda(pybind11::module_& m);
void register_plan(pybind11::module_& m);
void register_image(pybind11::module_& m);
void register_arrays(pybind11::module_& m);
void register_tiff(pybind11::module_& m);
void register_parquet(pybind11::module_& m);
void register_columns(pybind11::module_& m);

}  // namespace stoker::bindings
