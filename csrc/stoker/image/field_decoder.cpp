#include <memory>
#include <string>
#include <utility>

#include "stoker/image/image.hpp"

namespace stoker::image {

namespace {

class ImageDecoder final : public io::FieldDecoder {
 public:
  explicit ImageDecoder(std::shared_ptr<const Target> target) : target_(std::move(target)) {}

  uint64_t output_bytes() const override { return target_->nbytes(); }
  uint64_t max_input_bytes() const override { return kMaxEncodedBytes; }
  const char* input_name() const override { return "an encoded image"; }
  bool slow() const override { return true; }
  bool blank_on_error() const override { return target_->blank_on_error; }

  void decode(const uint8_t* src, uint64_t size, uint64_t seed, uint8_t* dest,
              const std::string& path, uint64_t offset) const override {
    decode_into(src, size, *target_, seed, dest, path, offset);
  }

 private:
  std::shared_ptr<const Target> target_;
};

}  // namespace

void register_decoders() {
  io::register_codec({kImage, "IMAGE", false, nullptr, true});
  io::register_codec({kDeflateImage, "DEFLATE_IMAGE", true, nullptr, true});
}

std::shared_ptr<const io::FieldDecoder> field_decoder(std::shared_ptr<const Target> target) {
  return std::make_shared<const ImageDecoder>(std::move(target));
}

}  // namespace stoker::image
