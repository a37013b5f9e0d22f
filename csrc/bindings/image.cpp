// Images: the field target a Loader's Image() becomes, and the one-off calls the
// tests, the decode benchmark and `stoker pack --image-size` use. Every call
// that decodes releases the GIL.
#include "stoker/image/image.hpp"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <chrono>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "numpy_util.hpp"
#include "stoker/image/codec.hpp"
#include "stoker/io/thread_pool.hpp"

namespace py = pybind11;

namespace stoker::bindings {

namespace {

using image::Target;

std::shared_ptr<Target> make_target(uint32_t height, uint32_t width, image::Crop crop,
                                    std::pair<double, double> scale,
                                    std::pair<double, double> ratio, bool flip, bool channels_last,
                                    bool blank_on_error) {
  if (height == 0 || width == 0 || height > 65535 || width > 65535) {
    throw py::value_error("an image size is 1 to 65535 pixels a side, not " +
                          std::to_string(height) + " x " + std::to_string(width));
  }
  if (!(scale.first > 0 && scale.first <= scale.second && scale.second <= 1)) {
    throw py::value_error("scale is (low, high) with 0 < low <= high <= 1");
  }
  if (!(ratio.first > 0 && ratio.first <= ratio.second)) {
    throw py::value_error("ratio is (low, high) with 0 < low <= high");
  }
  auto t = std::make_shared<Target>();
  t->height = height;
  t->width = width;
  t->crop = crop;
  t->scale_min = scale.first;
  t->scale_max = scale.second;
  t->ratio_min = ratio.first;
  t->ratio_max = ratio.second;
  t->flip = flip;
  t->channels_last = channels_last;
  t->blank_on_error = blank_on_error;
  return t;
}

// A buffer object's bytes, exported (a bytearray cannot be resized under a
// decode that runs without the GIL) for as long as this lives.
struct Exported {
  explicit Exported(const py::buffer& data) : info(data.request()) {
    if (!PyBuffer_IsContiguous(info.view(), 'C')) throw py::value_error("a contiguous buffer");
  }
  const uint8_t* data() const { return static_cast<const uint8_t*>(info.ptr); }
  uint64_t size() const { return uint64_t(info.size) * info.itemsize; }
  py::buffer_info info;
};

// One sample's shape, as a Loader's Image field hands it out.
py::tuple shape_of(const Target& t) {
  if (t.channels_last) return py::make_tuple(t.height, t.width, 3);
  return py::make_tuple(3, t.height, t.width);
}

py::array_t<uint8_t> rgb_array(image::Rgb&& rgb) {
  auto* owned = new std::vector<uint8_t>(std::move(rgb.pixels));
  py::capsule owner(owned, [](void* p) { delete static_cast<std::vector<uint8_t>*>(p); });
  return py::array_t<uint8_t>({size_t(rgb.height), size_t(rgb.width), size_t{3}},
                              {size_t(rgb.width) * 3, size_t{3}, size_t{1}}, owned->data(), owner);
}

}  // namespace

void register_image(py::module_& m) {
  py::enum_<image::Crop>(m, "Crop", "What part of an image a field keeps.")
      .value("RANDOM", image::Crop::kRandom)
      .value("CENTER", image::Crop::kCenter)
      .value("NONE", image::Crop::kNone);

  py::class_<Target, std::shared_ptr<Target>>(m, "ImageTarget",
                                              "What an image field's members become.")
      .def(py::init(&make_target), py::arg("height"), py::arg("width"), py::arg("crop"),
           py::arg("scale"), py::arg("ratio"), py::arg("flip"), py::arg("channels_last"),
           py::arg("blank_on_error"))
      .def_property_readonly("nbytes", &Target::nbytes)
      .def_property_readonly("shape", &shape_of);

  m.def("image_support", &image::supported,
        "Whether this build decodes images (it was built with libjpeg and libpng).");
  m.attr("MAX_IMAGE_PIXELS") = image::kMaxPixels;
  m.def(
      "jpeg_entropy_marks",
      [] {
        return py::make_tuple(image::detail::entropy_marks_work(),
                              image::detail::entropy_mcus_stepped_over(),
                              image::detail::entropy_mcus_skimmed());
      },
      "Whether JPEG tiles' entropy marks work with the libjpeg loaded; how many MCUs "
      "decodes in this process have stepped over with them; and how many they have skimmed "
      "with stoker's own entropy decoder (those between a mark and the first MCU used).");
  m.def("allow_jpeg_skim", &image::detail::allow_entropy_skim, py::arg("allowed"),
        "Whether JPEG tile decodes may skim the MCUs they do not use with stoker's own entropy "
        "decoder (they may, unless told otherwise); returns what it was. For tests that "
        "compare decodes made without it.");

  m.def(
      "decode_image",
      [](const py::buffer& data, std::shared_ptr<Target> target, uint64_t seed,
         const std::string& name) {
        Exported bytes(data);
        std::vector<uint8_t> out(target->nbytes());
        {
          py::gil_scoped_release release;
          image::decode_into(bytes.data(), bytes.size(), *target, seed, out.data(), name, 0);
        }
        return vector_to_numpy(std::move(out)).attr("reshape")(shape_of(*target));
      },
      py::arg("data"), py::arg("target").none(false), py::arg("seed") = 0,
      py::arg("name") = "<image>",
      "One image decoded as an Image field decodes it (seed: its random crop's seed).");

  m.def(
      "image_box",
      [](uint32_t width, uint32_t height, std::shared_ptr<Target> target, uint64_t seed) {
        image::Box b = image::choose_box(width, height, *target, seed);
        return py::make_tuple(b.x0, b.y0, b.x1, b.y1, b.flip);
      },
      py::arg("width"), py::arg("height"), py::arg("target").none(false), py::arg("seed") = 0,
      "The crop (x0, y0, x1, y1, flip) an Image field takes of a width x height image.");

  m.def(
      "decode_rgb",
      [](const py::buffer& data, const std::string& name) {
        Exported bytes(data);
        image::Rgb rgb;
        {
          py::gil_scoped_release release;
          rgb = image::decode_rgb(bytes.data(), bytes.size(), name, 0);
        }
        return rgb_array(std::move(rgb));
      },
      py::arg("data"), py::arg("name") = "<image>", "A whole image as an (H, W, 3) uint8 array.");

  m.def(
      "shrink_jpegs",
      [](const std::vector<py::bytes>& images, uint32_t shorter_side, int quality,
         size_t num_threads, const std::vector<std::string>& names) {
        if (names.size() != images.size()) throw py::value_error("one name per image");
        if (quality < 1 || quality > 100) throw py::value_error("quality is 1 to 100");
        std::vector<std::string_view> inputs;
        for (const py::bytes& b : images) inputs.push_back(std::string_view(b));
        std::vector<std::vector<uint8_t>> outputs(images.size());
        std::vector<std::string> errors(images.size());
        {
          py::gil_scoped_release release;
          io::parallel_for(inputs.size(), num_threads, [&](size_t i) {
            try {
              const auto* src = reinterpret_cast<const uint8_t*>(inputs[i].data());
              image::Rgb rgb = image::decode_rgb(src, inputs[i].size(), names[i], 0);
              uint32_t shorter = std::min(rgb.width, rgb.height);
              if (shorter <= shorter_side) return;  // small enough: kept as it is
              double f = double(shorter_side) / shorter;
              auto w = std::max<uint32_t>(1, uint32_t(std::lround(rgb.width * f)));
              auto h = std::max<uint32_t>(1, uint32_t(std::lround(rgb.height * f)));
              outputs[i] = image::encode_jpeg(image::resize_rgb(rgb, w, h), quality);
            } catch (const std::exception& e) {
              errors[i] = e.what();
            }
          });
        }
        py::list out, problems;
        for (size_t i = 0; i < images.size(); ++i) {
          problems.append(errors[i].empty() ? py::object(py::none()) : message_of(errors[i]));
          if (outputs[i].empty()) {
            out.append(py::none());
          } else {
            out.append(
                py::bytes(reinterpret_cast<const char*>(outputs[i].data()), outputs[i].size()));
          }
        }
        return py::make_tuple(out, problems);
      },
      py::arg("images"), py::arg("shorter_side"), py::arg("quality"), py::arg("num_threads"),
      py::arg("names"),
      "JPEGs re-encoded with their shorter side at most `shorter_side`, on `num_threads` "
      "threads: (images, errors), per image its new bytes (None: already that small, or it "
      "did not decode) and what was wrong with it (None: nothing).");

  m.def(
      "bench_decode",
      [](const std::vector<py::bytes>& images, uint32_t height, uint32_t width,
         size_t num_threads) {
        std::vector<std::string_view> inputs;
        for (const py::bytes& b : images) inputs.push_back(std::string_view(b));
        py::gil_scoped_release release;
        auto started = std::chrono::steady_clock::now();
        io::parallel_for(inputs.size(), num_threads, [&](size_t i) {
          const auto* src = reinterpret_cast<const uint8_t*>(inputs[i].data());
          try {
            image::Rgb rgb = image::decode_rgb(src, inputs[i].size(), "<image>", 0);
            image::resize_rgb(rgb, width, height);
          } catch (const std::exception&) {  // the benchmark's images all decode
          }
        });
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      },
      py::arg("images"), py::arg("height"), py::arg("width"), py::arg("num_threads"),
      "The decode ceiling: each image fully decoded and resized, on bare threads, no batching. "
      "Returns the seconds it took.");
}

}  // namespace stoker::bindings
