// ParseJsonStrict: nlohmann's SAX parser driving a document builder of our
// own that refuses a key an open object holds already (see json_strict.h). nlohmann's
// callback parser rescanned a whole object each time one of its members
// closed: a header of 40k small entries took 20 s, 200k never ended.
#include "engine/json_strict.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace ztier::engine {
namespace {

using Json = nlohmann::json;

// Deeper than any file of ztier's nests: a header of 100 MiB of '[' held
// gigabytes of open containers.
constexpr size_t kMaxDepth = 256;
// What a document's values may cost in memory per byte of its text, besides
// a fixed allowance (StrictBuilder::Spend): a file of ztier's costs a few
// times its size; one crafted of empty objects ('[{},{},...]', three bytes
// each) sixty times, 4 GB for a manifest of 64 MiB.
constexpr uint64_t kMaxCostPerByte = 16;
constexpr uint64_t kCostAllowance = uint64_t{1} << 20;

// Builds the document from the parser's events, refusing (by remembering
// the first) a key given twice in one object.
class StrictBuilder final : public nlohmann::json_sax<Json> {
 public:
  explicit StrictBuilder(uint64_t max_cost) : max_cost_(max_cost) {}
  Json& root() { return root_; }
  // The first key given twice in one object, dotted with the keys open
  // around it; nullopt if none (a key may be "").
  const std::optional<std::string>& duplicate() const { return duplicate_; }
  const std::string& error() const { return error_; }

  bool null() override { return Value(Json(nullptr), 0); }
  bool boolean(bool v) override { return Value(Json(v), 0); }
  bool number_integer(number_integer_t v) override { return Value(Json(v), 0); }
  bool number_unsigned(number_unsigned_t v) override { return Value(Json(v), 0); }
  bool number_float(number_float_t v, const string_t& /*text*/) override {
    return Value(Json(v), 0);
  }
  bool string(string_t& v) override {
    const uint64_t cost = kHeapString + HeapBytes(v);
    return Value(Json(std::move(v)), cost);
  }
  bool binary(binary_t& v) override {
    const uint64_t cost = kHeapString + v.size();
    return Value(Json::binary(std::move(v)), cost);
  }
  bool start_object(std::size_t /*elements*/) override { return Open(Json::object(), kHeapMap); }
  bool start_array(std::size_t /*elements*/) override { return Open(Json::array(), kHeapVector); }
  bool end_object() override { return Close(); }
  bool end_array() override { return Close(); }
  bool key(string_t& k) override {
    Frame& f = frames_.back();
    if (!Spend(kMapNode + HeapBytes(k))) return false;  // the member's node
    // The object holds its members so far (each added as its value began).
    if (f.container->contains(k) && !duplicate_) {
      // Dotted: the members open in the objects around this one, then it.
      std::string path;
      for (size_t i = 0; i + 1 < frames_.size(); ++i) {
        if (frames_[i].container->is_object()) path += frames_[i].key + ".";
      }
      duplicate_ = path + k;
    }
    f.key = std::move(k);
    return true;
  }
  bool parse_error(std::size_t /*position*/, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& ex) override {
    error_ = ex.what();
    return false;
  }

 private:
  struct Frame {
    Json* container;
    std::string key;  // an object's member being read
  };

  // What the parts of a document cost, about, malloc's overhead included:
  // an array's slot (16 bytes, and as much again as the vector grows), a
  // value held on the heap (a map, a vector, a string), an object's member
  // (a tree node with its key and value), and a string's characters past
  // the small-string buffer.
  static constexpr uint64_t kArraySlot = 32;
  static constexpr uint64_t kHeapMap = 64;
  static constexpr uint64_t kHeapVector = 40;
  static constexpr uint64_t kHeapString = 48;
  static constexpr uint64_t kMapNode = 96;
  static uint64_t HeapBytes(const std::string& s) { return s.size() > 15 ? s.size() + 17 : 0; }

  // False, with the error, once the document would cost more than allowed.
  bool Spend(uint64_t bytes) {
    cost_ += bytes;
    if (cost_ <= max_cost_) return true;
    error_ = StrCat("its values would take more than ", max_cost_ >> 20, " MiB of memory (",
                    kMaxCostPerByte,
                    " times the text, and 1 MiB; a file ztier wrote takes a few times its size)");
    return false;
  }
  // An array's slot (an object's member was counted with its key).
  uint64_t SlotCost() const {
    return !frames_.empty() && frames_.back().container->is_array() ? kArraySlot : 0;
  }

  // Places `v` where the parser is (the root, an array's end, an object's
  // current key); returns where it went. Addresses of open containers stay
  // valid: only the innermost one grows.
  Json* Add(Json v) {
    if (frames_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& f = frames_.back();
    if (f.container->is_array()) {
      f.container->push_back(std::move(v));
      return &f.container->back();
    }
    Json& slot = (*f.container)[f.key];
    slot = std::move(v);
    return &slot;
  }
  bool Value(Json v, uint64_t cost) {
    if (!Spend(SlotCost() + cost)) return false;
    Add(std::move(v));
    return true;
  }
  bool Open(Json empty, uint64_t cost) {
    if (frames_.size() >= kMaxDepth) {
      error_ = StrCat("arrays and objects nest more than ", kMaxDepth, " deep");
      return false;
    }
    if (!Spend(SlotCost() + cost)) return false;
    Json* c = Add(std::move(empty));
    frames_.push_back(Frame{c, {}});
    return true;
  }
  bool Close() {
    frames_.pop_back();
    return true;
  }

  const uint64_t max_cost_;
  uint64_t cost_ = 0;

  Json root_;
  std::vector<Frame> frames_;
  std::optional<std::string> duplicate_;
  std::string error_;
};

}  // namespace

Result<nlohmann::json> ParseJsonStrict(const std::string& text, std::string_view origin) {
  // nlohmann's parser ends the input at a NUL byte: whatever followed one
  // (a second half of the file) was dropped in silence.
  if (const size_t nul = text.find('\0'); nul != std::string::npos) {
    const size_t line_start = text.rfind('\n', nul);
    const size_t line = 1 + static_cast<size_t>(std::count(text.begin(), text.begin() + nul, '\n'));
    const size_t column = nul - (line_start == std::string::npos ? 0 : line_start + 1) + 1;
    return Status::InvalidArgument(StrCat(origin, ": a NUL byte at line ", line, ", column ",
                                          column, " (JSON is text; is this the right file?)"));
  }
  StrictBuilder builder(kMaxCostPerByte * text.size() + kCostAllowance);
  const bool parsed = Json::sax_parse(text, &builder, nlohmann::detail::input_format_t::json,
                                      /*strict=*/true, /*ignore_comments=*/false);
  if (!parsed) {
    // "[json.exception.parse_error.101] parse error at line L, column C:
    // ...; last read: '<everything since the last token>'": without the tag,
    // and only the end of what was read (it quoted whole lines of a file
    // that is not JSON, control characters spelled <U+000A>).
    std::string why = builder.error().empty() ? "invalid JSON" : builder.error();
    if (why.starts_with("[json.exception")) {
      if (const size_t tag = why.find("] "); tag != std::string::npos) why = why.substr(tag + 2);
    }
    if (const size_t read = why.find("; last read: '"); read != std::string::npos) {
      std::string near = why.substr(read + 14);
      if (!near.empty() && near.back() == '\'') near.pop_back();
      // Its last line, trimmed (the error's line and column say where).
      if (const size_t nl = near.rfind("<U+000A>"); nl != std::string::npos) {
        near = near.substr(nl + 8);
      }
      near.erase(0, std::min(near.size(), near.find_first_not_of(" \t")));
      if (near.size() > 40) near = near.substr(0, 40) + "...";
      why = near.empty() ? why.substr(0, read) : StrCat(why.substr(0, read), "; at '", near, "'");
    }
    return Status::InvalidArgument(StrCat(origin, ": ", why));
  }
  if (builder.duplicate()) {
    return Status::InvalidArgument(
        StrCat(origin, ": key '", *builder.duplicate(), "' is given twice"));
  }
  return std::move(builder.root());
}

}  // namespace ztier::engine
