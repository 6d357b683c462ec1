// GLM's chat format for text messages (see chat_template.h); each branch follows the matching branch of the jinja
// template in tests/golden/make_tokenizer_goldens.py, with Python's string methods spelled out.
#include "io/chat_template.h"

#include <string_view>

#include "core/error.h"

namespace nextlm {
namespace {

// Python's str.isspace() for one code point.
bool py_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// The code point starting at s[i] and its length (the text is valid UTF-8: it came from a JSON string or argv,
// checked by the tokenizer before use; a stray byte counts as one non-space character).
char32_t cp_at(std::string_view s, size_t i, size_t* len) {
  const auto b = static_cast<unsigned char>(s[i]);
  const size_t n = b < 0x80 ? 1 : b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
  if (i + n > s.size() || n == 1) {
    *len = 1;
    return b;
  }
  char32_t c = b & (n == 2 ? 0x1F : n == 3 ? 0x0F : 0x07);
  for (size_t k = 1; k < n; ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  *len = n;
  return c;
}

// Python's str.strip().
std::string py_strip(std::string_view s) {
  size_t a = 0;
  while (a < s.size()) {
    size_t n = 0;
    if (!py_space(cp_at(s, a, &n))) break;
    a += n;
  }
  size_t b = a, last_end = a;  // the end of the last non-space character
  while (b < s.size()) {
    size_t n = 0;
    const bool sp = py_space(cp_at(s, b, &n));
    b += n;
    if (!sp) last_end = b;
  }
  return std::string(s.substr(a, last_end - a));
}

std::string_view lstrip_newlines(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}

std::string_view rstrip_newlines(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

std::string render_glm_chat(const std::vector<ChatMessage>& messages, const ChatOptions& options) {
  const bool no_thinking = options.enable_thinking.has_value() && !*options.enable_thinking;
  long last_user = -1;
  for (size_t i = 0; i < messages.size(); ++i)
    if (messages[i].role == "user") last_user = static_cast<long>(i);

  std::string out = "[gMASK]<sop>";
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "user") {
      out += "<|user|>\n" + m.content;
      if (no_thinking && !ends_with(m.content, "/nothink")) out += "/nothink";
    } else if (m.role == "assistant") {
      out += "<|assistant|>";
      std::string_view content = m.content, reasoning;
      if (const size_t close = content.find("</think>"); close != std::string_view::npos) {
        reasoning = rstrip_newlines(content.substr(0, close));                  // split('</think>')[0].rstrip('\n')
        if (const size_t open = reasoning.rfind("<think>"); open != std::string_view::npos)
          reasoning = reasoning.substr(open + 7);                                // .split('<think>')[-1]
        reasoning = lstrip_newlines(reasoning);                                  // .lstrip('\n')
        content = lstrip_newlines(content.substr(content.rfind("</think>") + 8));  // split('</think>')[-1].lstrip
      }
      if (static_cast<long>(i) > last_user && !reasoning.empty()) {
        out += "\n<think>" + py_strip(reasoning) + "</think>";
      } else {
        out += "\n<think></think>";
      }
      const std::string answer = py_strip(content);
      if (!answer.empty()) out += "\n" + answer;
    } else if (m.role == "tool") {
      if (i == 0 || messages[i - 1].role != "tool") out += "<|observation|>";
      out += "\n<tool_response>\n" + m.content + "\n</tool_response>";
    } else if (m.role == "system") {
      out += "<|system|>\n" + m.content;
    } else {
      fail("chat message ", i, ": role \"", m.role, "\" is not system, user, assistant or tool");
    }
  }
  if (options.add_generation_prompt) {
    out += "<|assistant|>";
    if (no_thinking) out += "\n<think></think>";
  }
  return out;
}

}  // namespace nextlm
