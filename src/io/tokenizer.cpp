// Hugging Face tokenizer.json (byte-level BPE) — see tokenizer.h. Each stage names the HF `tokenizers` code it
// follows (0.23: added_vocabulary.rs, pre_tokenizers/split.rs and byte_level.rs, utils/onig.rs, models/bpe/word.rs,
// decoders/byte_level.rs).
#include "io/tokenizer.h"

#include <unicode/uchar.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <queue>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace nextlm {
namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------------------------
// UTF-8

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

// Length of the well-formed UTF-8 sequence at s[i], or 0 when it is ill-formed; *bad is then the length of its
// maximal ill-formed subpart (at least 1), which is what from_utf8_lossy replaces by one U+FFFD.
size_t utf8_seq(std::string_view s, size_t i, size_t* bad) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (b < 0x80) return 1;
  size_t width = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    width = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    width = 3;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    width = 4;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    *bad = 1;
    return 0;
  }
  for (size_t k = 1; k < width; ++k) {
    if (i + k >= s.size()) {
      *bad = k;
      return 0;
    }
    const auto c = static_cast<unsigned char>(s[i + k]);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (c < l || c > h) {
      *bad = k;
      return 0;
    }
  }
  return width;
}

char32_t utf8_decode_at(std::string_view s, size_t i, size_t len) {
  const auto b = static_cast<unsigned char>(s[i]);
  if (len == 1) return b;
  char32_t c = b & (len == 2 ? 0x1F : len == 3 ? 0x0F : 0x07);
  for (size_t k = 1; k < len; ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return c;
}

// Code points of valid UTF-8 and the byte offset of each (plus the end).
struct Utf32 {
  std::vector<char32_t> cps;
  std::vector<size_t> offsets;
};

Utf32 decode_utf8(std::string_view s, const char* what) {
  Utf32 u;
  u.cps.reserve(s.size());
  u.offsets.reserve(s.size() + 1);
  for (size_t i = 0; i < s.size();) {
    size_t bad = 0;
    const size_t n = utf8_seq(s, i, &bad);
    check(n > 0, what, " is not valid UTF-8 (byte ", i, ")");
    u.offsets.push_back(i);
    u.cps.push_back(utf8_decode_at(s, i, n));
    i += n;
  }
  u.offsets.push_back(s.size());
  return u;
}

// ---------------------------------------------------------------------------------------------------------------
// Unicode properties (ICU)

uint32_t cat_bit(char32_t c) { return 1u << u_charType(static_cast<UChar32>(c)); }

constexpr uint32_t bit(UCharCategory c) { return 1u << c; }
constexpr uint32_t kLetter = bit(U_UPPERCASE_LETTER) | bit(U_LOWERCASE_LETTER) | bit(U_TITLECASE_LETTER) |
                             bit(U_MODIFIER_LETTER) | bit(U_OTHER_LETTER);
constexpr uint32_t kMark = bit(U_NON_SPACING_MARK) | bit(U_ENCLOSING_MARK) | bit(U_COMBINING_SPACING_MARK);
constexpr uint32_t kNumber = bit(U_DECIMAL_DIGIT_NUMBER) | bit(U_LETTER_NUMBER) | bit(U_OTHER_NUMBER);
constexpr uint32_t kSeparator = bit(U_SPACE_SEPARATOR) | bit(U_LINE_SEPARATOR) | bit(U_PARAGRAPH_SEPARATOR);
constexpr uint32_t kPunct = bit(U_DASH_PUNCTUATION) | bit(U_START_PUNCTUATION) | bit(U_END_PUNCTUATION) |
                            bit(U_CONNECTOR_PUNCTUATION) | bit(U_OTHER_PUNCTUATION) | bit(U_INITIAL_PUNCTUATION) |
                            bit(U_FINAL_PUNCTUATION);
constexpr uint32_t kSymbol =
    bit(U_MATH_SYMBOL) | bit(U_CURRENCY_SYMBOL) | bit(U_MODIFIER_SYMBOL) | bit(U_OTHER_SYMBOL);
constexpr uint32_t kOther = bit(U_CONTROL_CHAR) | bit(U_FORMAT_CHAR) | bit(U_PRIVATE_USE_CHAR) | bit(U_SURROGATE) |
                            bit(U_GENERAL_OTHER_TYPES);

// Oniguruma's Unicode \s: U+0009–U+000D, U+0085 and the separators (Zs, Zl, Zp) — the White_Space property.
bool onig_space(char32_t c) { return (c >= 9 && c <= 13) || c == 0x85 || (cat_bit(c) & kSeparator); }
// Oniguruma's Unicode \w: Letter, Mark, Number, Connector_Punctuation.
bool onig_word(char32_t c) {
  return cat_bit(c) & (kLetter | kMark | kNumber | bit(U_CONNECTOR_PUNCTUATION));
}
// Rust regex's Unicode \w and \s (used by HF for added tokens' single_word / lstrip / rstrip).
bool rust_word(char32_t c) {
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_ALPHABETIC) ||
         (cat_bit(c) & (kMark | bit(U_DECIMAL_DIGIT_NUMBER) | bit(U_CONNECTOR_PUNCTUATION))) ||
         u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_JOIN_CONTROL);
}
bool rust_space(char32_t c) { return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_WHITE_SPACE); }

char32_t fold(char32_t c) { return static_cast<char32_t>(u_foldCase(static_cast<UChar32>(c), U_FOLD_CASE_DEFAULT)); }

// General-category names of \p{...}: one- and two-letter forms and the long names of the groups.
std::optional<uint32_t> category_mask(const std::string& name) {
  static const std::map<std::string, uint32_t> names = {
      {"L", kLetter}, {"Letter", kLetter}, {"Lu", bit(U_UPPERCASE_LETTER)}, {"Ll", bit(U_LOWERCASE_LETTER)},
      {"Lt", bit(U_TITLECASE_LETTER)}, {"Lm", bit(U_MODIFIER_LETTER)}, {"Lo", bit(U_OTHER_LETTER)},
      {"M", kMark}, {"Mark", kMark}, {"Mn", bit(U_NON_SPACING_MARK)}, {"Mc", bit(U_COMBINING_SPACING_MARK)},
      {"Me", bit(U_ENCLOSING_MARK)}, {"N", kNumber}, {"Number", kNumber}, {"Nd", bit(U_DECIMAL_DIGIT_NUMBER)},
      {"Nl", bit(U_LETTER_NUMBER)}, {"No", bit(U_OTHER_NUMBER)}, {"P", kPunct}, {"Punctuation", kPunct},
      {"Pc", bit(U_CONNECTOR_PUNCTUATION)}, {"Pd", bit(U_DASH_PUNCTUATION)}, {"Ps", bit(U_START_PUNCTUATION)},
      {"Pe", bit(U_END_PUNCTUATION)}, {"Pi", bit(U_INITIAL_PUNCTUATION)}, {"Pf", bit(U_FINAL_PUNCTUATION)},
      {"Po", bit(U_OTHER_PUNCTUATION)}, {"S", kSymbol}, {"Symbol", kSymbol}, {"Sm", bit(U_MATH_SYMBOL)},
      {"Sc", bit(U_CURRENCY_SYMBOL)}, {"Sk", bit(U_MODIFIER_SYMBOL)}, {"So", bit(U_OTHER_SYMBOL)},
      {"Z", kSeparator}, {"Separator", kSeparator}, {"Zs", bit(U_SPACE_SEPARATOR)},
      {"Zl", bit(U_LINE_SEPARATOR)}, {"Zp", bit(U_PARAGRAPH_SEPARATOR)}, {"C", kOther}, {"Other", kOther},
      {"Cc", bit(U_CONTROL_CHAR)}, {"Cf", bit(U_FORMAT_CHAR)}, {"Co", bit(U_PRIVATE_USE_CHAR)},
      {"Cs", bit(U_SURROGATE)}, {"Cn", bit(U_GENERAL_OTHER_TYPES)}};
  const auto it = names.find(name);
  if (it == names.end()) return std::nullopt;
  return it->second;
}

// ---------------------------------------------------------------------------------------------------------------
// Regex: a backtracking matcher for the subset pre-tokenizer patterns use, with Oniguruma's semantics (ordered
// alternation, greedy / lazy / possessive quantifiers with backtracking, lookahead, (?i:...) with simple case
// folding). A repeat of one character runs as a loop; a repeated group recurses once per iteration, which is fine for
// the short groups of pre-tokenizer patterns. Supported: literals and escapes (\r \n \t \f \v \e \a \xHH \x{H..}
// \uHHHH, escaped punctuation), ., [...] sets with ranges, negation and classes, \s \S \d \D \w \W, \h \H (hex digit,
// as Oniguruma), \p{..} \P{..} \p{^..} (general categories), groups (...) (?:...) (?i:...) (?-i:...) (?=...) (?!...),
// ^ $ (line anchors) \A \z, quantifiers ? * + {n} {n,} {n,m} with ? or + suffixes. Anything else is a load error.

struct SetItem {
  enum Kind { Range, Cats, Space, Word, Digit, Hex } kind = Range;
  bool negated = false;
  char32_t lo = 0, hi = 0;
  uint32_t cats = 0;
};

struct CharSet {
  std::vector<SetItem> items;
  bool negated = false;
  bool icase = false;

  bool item_match(char32_t c) const {
    for (const SetItem& it : items) {
      bool m = false;
      switch (it.kind) {
        case SetItem::Range: m = c >= it.lo && c <= it.hi; break;
        case SetItem::Cats: m = (cat_bit(c) & it.cats) != 0; break;
        case SetItem::Space: m = onig_space(c); break;
        case SetItem::Word: m = onig_word(c); break;
        case SetItem::Digit: m = (cat_bit(c) & bit(U_DECIMAL_DIGIT_NUMBER)) != 0; break;
        case SetItem::Hex: m = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); break;
      }
      if (m != it.negated) return true;
    }
    return false;
  }
  bool match(char32_t c) const {
    bool m = item_match(c);
    if (!m && icase) {
      for (UChar32 v : {u_foldCase(static_cast<UChar32>(c), U_FOLD_CASE_DEFAULT), u_toupper(static_cast<UChar32>(c)),
                        u_tolower(static_cast<UChar32>(c)), u_totitle(static_cast<UChar32>(c))})
        if (static_cast<char32_t>(v) != c && item_match(static_cast<char32_t>(v))) {
          m = true;
          break;
        }
    }
    return m != negated;
  }
};

struct Node {
  // Begin, End: \A, \z; LineBegin, LineEnd: ^, $ (Oniguruma's are line anchors).
  enum Kind { Empty, Char, Set, Any, Concat, Alt, Repeat, Look, Begin, End, LineBegin, LineEnd } kind = Empty;
  char32_t ch = 0;
  bool icase = false;
  CharSet set;
  std::vector<Node> kids;
  int min = 0, max = -1;  // Repeat; max −1: unbounded
  bool greedy = true, possessive = false;
  bool look_negated = false;  // Look: (?!...)

  // A node that matches exactly one code point (repeats of it are matched without recursion).
  bool single() const { return kind == Char || kind == Set || kind == Any; }
  bool match1(char32_t c) const {
    switch (kind) {
      case Char: return icase ? fold(c) == fold(ch) : c == ch;
      case Set: return set.match(c);
      case Any: return c != '\n';
      default: return false;
    }
  }
};

class RegexParser {
 public:
  RegexParser(const std::string& pattern, const std::string& what)
      : what_(what), p_(decode_utf8(pattern, (what + ": the regex").c_str()).cps) {}

  Node parse() {
    Node n = alternation(false);
    if (i_ != p_.size()) error("unmatched ')'");
    return n;
  }

 private:
  [[noreturn]] void error(const std::string& msg) const {
    fail(what_, ": unsupported or malformed regex (", msg, " at character ", i_, ")");
  }
  bool more() const { return i_ < p_.size(); }
  char32_t peek() const { return p_[i_]; }
  bool eat(char32_t c) {
    if (more() && peek() == c) {
      ++i_;
      return true;
    }
    return false;
  }

  Node alternation(bool icase) {
    std::vector<Node> alts;
    alts.push_back(concat(icase));
    while (eat('|')) alts.push_back(concat(icase));
    if (alts.size() == 1) return std::move(alts[0]);
    Node n;
    n.kind = Node::Alt;
    n.kids = std::move(alts);
    return n;
  }

  Node concat(bool icase) {
    Node n;
    n.kind = Node::Concat;
    while (more() && peek() != '|' && peek() != ')') n.kids.push_back(quantified(icase));
    return n;
  }

  int number() {
    if (!more() || peek() < '0' || peek() > '9') error("expected a number");
    long v = 0;
    while (more() && peek() >= '0' && peek() <= '9') {
      v = v * 10 + (peek() - '0');
      if (v > 100000) error("repeat count too large");
      ++i_;
    }
    return static_cast<int>(v);
  }

  Node quantified(bool icase) {
    Node atom_node = atom(icase);
    while (more()) {
      int lo = 0, hi = -1;
      const size_t save = i_;
      if (eat('?')) {
        hi = 1;
      } else if (eat('*')) {
      } else if (eat('+')) {
        lo = 1;
      } else if (peek() == '{') {
        ++i_;
        if (!more() || peek() < '0' || peek() > '9') {  // a literal '{' as Oniguruma reads it
          i_ = save;
          break;
        }
        lo = number();
        hi = lo;
        if (eat(',')) hi = (more() && peek() == '}') ? -1 : number();
        if (!eat('}')) error("expected '}'");
        if (hi != -1 && hi < lo) error("bad repeat range");
      } else {
        break;
      }
      if (atom_node.kind == Node::Begin || atom_node.kind == Node::End || atom_node.kind == Node::LineBegin ||
          atom_node.kind == Node::LineEnd || atom_node.kind == Node::Look)
        error("quantifier after an anchor or lookaround");
      Node r;
      r.kind = Node::Repeat;
      r.min = lo;
      r.max = hi;
      if (eat('?')) r.greedy = false;
      else if (eat('+')) r.possessive = true;
      r.kids.push_back(std::move(atom_node));
      atom_node = std::move(r);
    }
    return atom_node;
  }

  char32_t hex(size_t digits_min, size_t digits_max) {
    char32_t v = 0;
    size_t n = 0;
    while (n < digits_max && more() && std::isxdigit(static_cast<int>(peek() < 128 ? peek() : 0))) {
      const char32_t c = peek();
      v = v * 16 + (c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
      ++i_;
      ++n;
    }
    if (n < digits_min) error("bad hex escape");
    return v;
  }

  // After a backslash: a single code point (returns true and sets *c) or a class (fills *item).
  bool escape(char32_t* c, SetItem* item) {
    if (!more()) error("trailing backslash");
    const char32_t e = p_[i_++];
    switch (e) {
      case 'n': *c = '\n'; return true;
      case 'r': *c = '\r'; return true;
      case 't': *c = '\t'; return true;
      case 'f': *c = '\f'; return true;
      case 'v': *c = '\v'; return true;
      case 'a': *c = 7; return true;
      case 'e': *c = 27; return true;
      case 'x':
        if (eat('{')) {
          *c = hex(1, 8);
          if (!eat('}')) error("expected '}'");
        } else {
          *c = hex(1, 2);
        }
        return true;
      case 'u': *c = hex(4, 4); return true;
      case 's': case 'S': item->kind = SetItem::Space; item->negated = e == 'S'; return false;
      case 'd': case 'D': item->kind = SetItem::Digit; item->negated = e == 'D'; return false;
      case 'w': case 'W': item->kind = SetItem::Word; item->negated = e == 'W'; return false;
      case 'h': case 'H': item->kind = SetItem::Hex; item->negated = e == 'H'; return false;
      case 'p': case 'P': {
        item->kind = SetItem::Cats;
        item->negated = e == 'P';
        std::string name;
        if (eat('{')) {
          if (eat('^')) item->negated = !item->negated;
          while (more() && peek() != '}') {
            if (peek() > 127) error("bad property name");
            name.push_back(static_cast<char>(p_[i_++]));
          }
          if (!eat('}')) error("expected '}'");
        } else if (more() && peek() < 128) {
          name.push_back(static_cast<char>(p_[i_++]));
        }
        const auto mask = category_mask(name);
        if (!mask) error("unknown property \\p{" + name + "}");
        item->cats = *mask;
        return false;
      }
      default:
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '0' && e <= '9'))
          error(std::string("escape \\") + static_cast<char>(e));
        *c = e;  // escaped punctuation or any other character stands for itself
        return true;
    }
  }

  Node char_set(bool icase) {
    Node n;
    n.kind = Node::Set;
    n.set.icase = icase;
    if (eat('^')) n.set.negated = true;
    bool first = true;
    while (true) {
      if (!more()) error("unterminated [");
      if (peek() == ']' && !first) {
        ++i_;
        break;
      }
      first = false;
      if (peek() == '[') error("nested set");
      if (peek() == '&' && i_ + 1 < p_.size() && p_[i_ + 1] == '&') error("set intersection");
      char32_t lo = 0;
      SetItem item;
      if (eat('\\')) {
        if (!escape(&lo, &item)) {
          n.set.items.push_back(item);
          continue;
        }
      } else {
        lo = p_[i_++];
      }
      char32_t hi = lo;
      if (more() && peek() == '-' && i_ + 1 < p_.size() && p_[i_ + 1] != ']') {
        ++i_;
        if (eat('\\')) {
          SetItem unused;
          if (!escape(&hi, &unused)) error("class in a range");
        } else {
          hi = p_[i_++];
        }
        if (hi < lo) error("bad range");
      }
      item.kind = SetItem::Range;
      item.lo = lo;
      item.hi = hi;
      n.set.items.push_back(item);
    }
    return n;
  }

  Node atom(bool icase) {
    const char32_t c = p_[i_++];
    Node n;
    switch (c) {
      case '(': {
        bool sub_icase = icase;
        if (eat('?')) {
          if (eat(':')) {
          } else if (eat('=') || (more() && peek() == '!')) {
            n.kind = Node::Look;
            n.look_negated = eat('!');
            n.kids.push_back(alternation(icase));
            if (!eat(')')) error("expected ')'");
            return n;
          } else {
            bool on = true, any = false;
            while (more() && (peek() == 'i' || peek() == '-')) {
              if (p_[i_++] == '-') on = false;
              else sub_icase = on;
              any = true;
            }
            if (!any || !eat(':')) error("unsupported group");
          }
        }
        Node inner = alternation(sub_icase);
        if (!eat(')')) error("expected ')'");
        return inner;
      }
      case '[': return char_set(icase);
      case '.': n.kind = Node::Any; return n;
      case '^': n.kind = Node::LineBegin; return n;
      case '$': n.kind = Node::LineEnd; return n;
      case ')': case '|': case '*': case '+': case '?': --i_; error("misplaced metacharacter");
      case '\\': {
        if (more() && (peek() == 'A' || peek() == 'z')) {
          n.kind = p_[i_++] == 'A' ? Node::Begin : Node::End;
          return n;
        }
        char32_t ch = 0;
        SetItem item;
        if (escape(&ch, &item)) {
          n.kind = Node::Char;
          n.ch = ch;
          n.icase = icase;
        } else {
          n.kind = Node::Set;
          n.set.items.push_back(item);
        }
        return n;
      }
      default:
        n.kind = Node::Char;
        n.ch = c;
        n.icase = icase;
        return n;
    }
  }

  std::string what_;
  std::vector<char32_t> p_;
  size_t i_ = 0;
};

class Regex {
 public:
  Regex(const std::string& pattern, const std::string& what) : root_(RegexParser(pattern, what).parse()) {}

  // Non-overlapping matches [start, end) in code-point indices, as onig's find_iter (an empty match right after the
  // previous match is skipped).
  std::vector<std::pair<size_t, size_t>> find_all(const std::vector<char32_t>& s) const {
    std::vector<std::pair<size_t, size_t>> out;
    size_t from = 0;
    std::optional<size_t> last_end;
    while (from <= s.size()) {
      bool found = false;
      size_t ms = 0, me = 0;
      for (size_t st = from; st <= s.size(); ++st) {
        size_t end = 0;
        if (match_at(s, st, &end)) {
          found = true;
          ms = st;
          me = end;
          break;
        }
      }
      if (!found) break;
      if (me == ms && last_end && *last_end == me) {
        from += 1;
        continue;
      }
      out.emplace_back(ms, me);
      last_end = me;
      from = me == ms ? me + 1 : me;
      if (me == ms && me >= s.size()) break;
    }
    return out;
  }

 private:
  using Cont = std::function<bool(size_t)>;

  bool match_at(const std::vector<char32_t>& s, size_t pos, size_t* end) const {
    return m(root_, s, pos, [&](size_t e) {
      *end = e;
      return true;
    });
  }

  // Matches node n at pos, then calls k with the end; backtracks into n while k fails.
  bool m(const Node& n, const std::vector<char32_t>& s, size_t pos, const Cont& k) const {
    switch (n.kind) {
      case Node::Empty: return k(pos);
      case Node::Char:
      case Node::Set:
      case Node::Any: return pos < s.size() && n.match1(s[pos]) && k(pos + 1);
      case Node::Begin: return pos == 0 && k(pos);
      case Node::End: return pos == s.size() && k(pos);
      case Node::LineBegin: return (pos == 0 || s[pos - 1] == '\n') && k(pos);
      case Node::LineEnd: return (pos == s.size() || s[pos] == '\n') && k(pos);
      case Node::Concat: return seq(n, 0, s, pos, k);
      case Node::Alt:
        for (const Node& a : n.kids)
          if (m(a, s, pos, k)) return true;
        return false;
      case Node::Look: {
        const bool found = m(n.kids[0], s, pos, [](size_t) { return true; });
        return found != n.look_negated && k(pos);
      }
      case Node::Repeat: return repeat(n, s, pos, k);
    }
    return false;
  }

  bool seq(const Node& n, size_t i, const std::vector<char32_t>& s, size_t pos, const Cont& k) const {
    if (i == n.kids.size()) return k(pos);
    return m(n.kids[i], s, pos, [&](size_t p) { return seq(n, i + 1, s, p, k); });
  }

  bool repeat(const Node& n, const std::vector<char32_t>& s, size_t pos, const Cont& k) const {
    const Node& sub = n.kids[0];
    const size_t max = n.max < 0 ? SIZE_MAX : static_cast<size_t>(n.max);
    const size_t min = static_cast<size_t>(n.min);
    if (sub.single()) {  // count the run once, then try the continuation from each admissible length
      size_t run = 0;
      while (run < max && pos + run < s.size() && sub.match1(s[pos + run])) ++run;
      if (run < min) return false;
      if (n.possessive) return k(pos + run);
      if (n.greedy) {
        for (size_t r = run + 1; r-- > min;)
          if (k(pos + r)) return true;
      } else {
        for (size_t r = min; r <= run; ++r)
          if (k(pos + r)) return true;
      }
      return false;
    }
    if (n.possessive) {  // the greedy match of the repeat alone, then no backtracking into it
      size_t end = 0;
      if (!rec(n, 0, min, max, true, s, pos, [&](size_t e) {
            end = e;
            return true;
          }))
        return false;
      return k(end);
    }
    return rec(n, 0, min, max, n.greedy, s, pos, k);
  }

  bool rec(const Node& n, size_t count, size_t min, size_t max, bool greedy, const std::vector<char32_t>& s,
           size_t pos, const Cont& k) const {
    auto again = [&](size_t p) {
      if (p == pos && count >= min) return false;  // an empty iteration would loop forever
      return rec(n, count + 1, min, max, greedy, s, p, k);
    };
    if (count < min) return m(n.kids[0], s, pos, again);
    if (greedy) {
      if (count < max && m(n.kids[0], s, pos, again)) return true;
      return k(pos);
    }
    if (k(pos)) return true;
    return count < max && m(n.kids[0], s, pos, again);
  }

  Node root_;
};

// ---------------------------------------------------------------------------------------------------------------
// Byte-level map (GPT-2's bytes_to_unicode): printable bytes map to themselves, the others to U+0100 onwards.

struct ByteMap {
  std::string byte_char[256];                 // UTF-8 of the character for each byte
  std::unordered_map<char32_t, uint8_t> rev;  // character → byte
  ByteMap() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t c = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      append_utf8(byte_char[b], c);
      rev[c] = static_cast<uint8_t>(b);
    }
  }
};

const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

std::string byte_level(std::string_view s) {
  std::string out;
  out.reserve(s.size() * 2);
  for (unsigned char b : s) out += byte_map().byte_char[b];
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Pre-tokenizers

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// HF's NormalizedString::split: matches (start, end, is_match) cover the string; returns the kept pieces.
std::vector<std::pair<size_t, size_t>> apply_behavior(std::vector<std::tuple<size_t, size_t, bool>> matches,
                                                      Behavior b, bool invert) {
  if (invert)
    for (auto& m : matches) std::get<2>(m) = !std::get<2>(m);
  std::vector<std::pair<size_t, size_t>> out;
  switch (b) {
    case Behavior::Isolated:
      for (auto& [s, e, is] : matches) out.emplace_back(s, e);
      break;
    case Behavior::Removed:
      for (auto& [s, e, is] : matches)
        if (!is) out.emplace_back(s, e);
      break;
    case Behavior::MergedWithPrevious: {
      bool prev = false;
      for (auto& [s, e, is] : matches) {
        if (is && !prev && !out.empty()) out.back().second = e;
        else out.emplace_back(s, e);
        prev = is;
      }
      break;
    }
    case Behavior::MergedWithNext: {
      bool prev = false;
      for (auto it = matches.rbegin(); it != matches.rend(); ++it) {
        auto& [s, e, is] = *it;
        if (is && !prev && !out.empty()) out.back().first = s;
        else out.emplace_back(s, e);
        prev = is;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
    case Behavior::Contiguous: {
      bool prev = false;
      for (auto& [s, e, is] : matches) {
        if (is == prev && !out.empty()) out.back().second = e;
        else out.emplace_back(s, e);
        prev = is;
      }
      break;
    }
  }
  std::erase_if(out, [](const auto& p) { return p.first == p.second; });
  return out;
}

// Matches (start, end, is_match) covering s, from regex matches given in code points.
std::vector<std::tuple<size_t, size_t, bool>> cover(const std::vector<std::pair<size_t, size_t>>& found,
                                                     size_t n) {
  std::vector<std::tuple<size_t, size_t, bool>> out;
  size_t prev = 0;
  for (const auto& [s, e] : found) {
    if (prev != s) out.emplace_back(prev, s, false);
    out.emplace_back(s, e, true);
    prev = e;
  }
  if (prev != n) out.emplace_back(prev, n, false);
  return out;
}

const char* kGpt2Regex = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct PreTokenizer {
  enum Kind { SplitRegex, SplitString, ByteLevel } kind;
  std::shared_ptr<Regex> regex;  // SplitRegex; ByteLevel with use_regex
  std::string literal;           // SplitString
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
  bool add_prefix_space = false;  // ByteLevel

  // Splits one piece (its text is UTF-8, not yet byte-mapped unless an earlier ByteLevel mapped it).
  void apply(const std::string& piece, std::vector<std::string>& out) const {
    if (kind == SplitString) {
      std::vector<std::tuple<size_t, size_t, bool>> matches;
      size_t prev = 0;
      if (!literal.empty()) {
        for (size_t at = piece.find(literal); at != std::string::npos; at = piece.find(literal, at + literal.size())) {
          if (prev != at) matches.emplace_back(prev, at, false);
          matches.emplace_back(at, at + literal.size(), true);
          prev = at + literal.size();
        }
      }
      if (prev != piece.size()) matches.emplace_back(prev, piece.size(), false);
      for (const auto& [s, e] : apply_behavior(std::move(matches), behavior, invert))
        out.push_back(piece.substr(s, e - s));
      return;
    }
    std::string text = piece;
    if (kind == ByteLevel && add_prefix_space && text.rfind(' ', 0) != 0) text.insert(text.begin(), ' ');
    std::vector<std::string> parts;
    if (regex) {
      const Utf32 u = decode_utf8(text, "the text");
      for (const auto& [s, e] : apply_behavior(cover(regex->find_all(u.cps), u.cps.size()),
                                               kind == ByteLevel ? Behavior::Isolated : behavior, invert))
        parts.push_back(text.substr(u.offsets[s], u.offsets[e] - u.offsets[s]));
    } else if (!text.empty()) {
      parts.push_back(text);
    }
    for (std::string& p : parts) out.push_back(kind == ByteLevel ? byte_level(p) : std::move(p));
  }
};

// ---------------------------------------------------------------------------------------------------------------
// JSON helpers: every access names the field, so a malformed file gives a one-line error.

const json& at(const json& j, const char* key, const std::string& where) {
  check(j.is_object(), where, " must be an object");
  const auto it = j.find(key);
  check(it != j.end(), where, ".", key, " is missing");
  return *it;
}

bool get_bool(const json& j, const char* key, bool def, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  check(it->is_boolean(), where, ".", key, " must be true or false");
  return it->get<bool>();
}

std::string get_string(const json& j, const char* key, const std::string& where) {
  const json& v = at(j, key, where);
  check(v.is_string(), where, ".", key, " must be a string");
  return v.get<std::string>();
}

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

struct Merge {
  uint32_t rank;
  int32_t new_id;
};

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string what;
  // Model (BPE).
  std::unordered_map<std::string, int32_t> vocab;
  std::unordered_map<int32_t, std::string> vocab_r;
  std::unordered_map<uint64_t, Merge> merges;
  std::optional<std::string> unk_token;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  // Added tokens.
  std::vector<AddedToken> added;                    // in HF's matching order: special ones first, then the others
  std::unordered_map<std::string, int32_t> added_map;
  std::unordered_map<int32_t, size_t> added_by_id;  // id → index in `added`
  std::unordered_set<std::string> special_set;
  std::vector<size_t> by_first_byte[256];           // indices in `added` by the first byte of their content
  std::vector<PreTokenizer> pre;
  int64_t size = 0;

  std::optional<int32_t> id_of(std::string_view t) const {
    if (auto it = added_map.find(std::string(t)); it != added_map.end()) return it->second;
    if (auto it = vocab.find(std::string(t)); it != vocab.end()) return it->second;
    return std::nullopt;
  }
  const std::string* token_of(int32_t id) const {
    if (auto it = added_by_id.find(id); it != added_by_id.end()) return &added[it->second].content;
    if (auto it = vocab_r.find(id); it != vocab_r.end()) return &it->second;
    return nullptr;
  }

  // HF's AddedVocabulary::find_matches on s with the added tokens whose `normalized` flag is `normalized`:
  // (index in `added` or −1 for text between tokens, byte range in s).
  std::vector<std::tuple<int, size_t, size_t>> split_added(std::string_view s, bool normalized) const {
    std::vector<std::tuple<int, size_t, size_t>> out;
    size_t start_offset = 0;
    size_t pos = 0;
    while (pos < s.size()) {
      // Leftmost-longest (aho-corasick's MatchKind::LeftmostLongest): the first position where some token starts,
      // the longest token there.
      int best = -1;
      size_t at = pos;
      for (; at < s.size(); ++at) {
        size_t best_len = 0;
        for (size_t t : by_first_byte[static_cast<unsigned char>(s[at])]) {
          const std::string& c = added[t].content;
          if (added[t].normalized == normalized && c.size() > best_len && s.compare(at, c.size(), c) == 0) {
            best = static_cast<int>(t);
            best_len = c.size();
          }
        }
        if (best >= 0) break;
      }
      if (best < 0) break;
      size_t start = at, stop = at + added[best].content.size();
      pos = stop;  // the automaton goes on after the match, whatever the flags do below
      const AddedToken& tok = added[best];
      if (tok.single_word) {
        const bool start_space = start == 0 || !rust_word(last_cp(s.substr(0, start)));
        const bool stop_space = stop == s.size() || !rust_word(first_cp(s.substr(stop)));
        if (!start_space || !stop_space) continue;
      }
      if (tok.lstrip) {
        size_t ns = start;
        while (ns > 0) {
          size_t b = ns - 1;
          while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
          if (!rust_space(first_cp(s.substr(b)))) break;
          ns = b;
        }
        start = std::max(ns, start_offset);
      }
      if (tok.rstrip) {
        while (stop < s.size()) {
          size_t bad = 0;
          const size_t n = utf8_seq(s, stop, &bad);
          if (!rust_space(utf8_decode_at(s, stop, n))) break;
          stop += n;
        }
      }
      if (start_offset < start) out.emplace_back(-1, start_offset, start);
      out.emplace_back(best, start, stop);
      start_offset = stop;
    }
    if (start_offset != s.size()) out.emplace_back(-1, start_offset, s.size());
    return out;
  }

  // The text cut by the added tokens: first those matched on the raw text (normalized: false), then, in the spans
  // left, those matched on the normalized text (the same text here: there is no normalizer).
  std::vector<std::tuple<int, size_t, size_t>> segments(std::string_view s) const {
    std::vector<std::tuple<int, size_t, size_t>> out;
    for (const auto& [tok, a, b] : split_added(s, false)) {
      if (tok >= 0) {
        out.emplace_back(tok, a, b);
        continue;
      }
      for (const auto& [tok2, c, d] : split_added(s.substr(a, b - a), true)) out.emplace_back(tok2, a + c, a + d);
    }
    return out;
  }

  static char32_t first_cp(std::string_view s) {
    size_t bad = 0;
    return utf8_decode_at(s, 0, utf8_seq(s, 0, &bad));
  }
  static char32_t last_cp(std::string_view s) {
    size_t b = s.size() - 1;
    while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
    return first_cp(s.substr(b));
  }

  std::vector<std::string> pre_tokenize(const std::string& text) const {
    std::vector<std::string> pieces{text};
    if (text.empty()) pieces.clear();
    for (const PreTokenizer& p : pre) {
      std::vector<std::string> next;
      for (const std::string& piece : pieces) p.apply(piece, next);
      pieces = std::move(next);
    }
    return pieces;
  }

  // HF's BPE::merge_word + Word::merge_all.
  void bpe(const std::string& w, std::vector<int32_t>& ids) const {
    if (ignore_merges) {
      if (auto it = vocab.find(w); it != vocab.end()) {
        ids.push_back(it->second);
        return;
      }
    }
    struct Sym {
      int32_t c;
      int prev, next;
      size_t len;
    };
    std::vector<Sym> syms;
    bool has_unk = false;  // a pending unknown run: its id and byte length
    int32_t unk_id = 0;
    size_t unk_len = 0;
    auto add = [&](int32_t id, size_t len) {
      const int i = static_cast<int>(syms.size());
      syms.push_back({id, i - 1, i + 1, len});
    };
    for (size_t i = 0; i < w.size();) {
      size_t bad = 0;
      size_t n = utf8_seq(w, i, &bad);
      if (n == 0) n = 1;
      const std::string ch = w.substr(i, n);
      i += n;
      if (auto it = vocab.find(ch); it != vocab.end()) {
        if (has_unk) add(unk_id, unk_len);
        has_unk = false;
        add(it->second, n);
        continue;
      }
      if (byte_fallback) {
        std::vector<int32_t> bytes;
        for (unsigned char b : ch) {
          char code[8];
          std::snprintf(code, sizeof code, "<0x%02X>", b);
          auto it = vocab.find(code);
          if (it == vocab.end()) break;
          bytes.push_back(it->second);
        }
        if (bytes.size() == ch.size()) {
          for (int32_t b : bytes) add(b, 1);
          continue;
        }
      }
      if (unk_token) {
        if (has_unk && fuse_unk) {
          unk_len += n;
        } else {
          if (has_unk) add(unk_id, unk_len);
          has_unk = true;
          unk_id = vocab.at(*unk_token);
          unk_len = n;
        }
      }
    }
    if (has_unk) add(unk_id, unk_len);
    if (!syms.empty()) syms.back().next = -1;

    struct Cand {
      uint32_t rank;
      size_t pos;
      int32_t new_id;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> queue;
    for (size_t i = 0; i + 1 < syms.size(); ++i)
      if (auto it = merges.find(pair_key(syms[i].c, syms[i + 1].c)); it != merges.end())
        queue.push({it->second.rank, i, it->second.new_id});
    while (!queue.empty()) {
      const Cand top = queue.top();
      queue.pop();
      Sym& cur = syms[top.pos];
      if (cur.len == 0 || cur.next == -1) continue;
      const size_t next_pos = static_cast<size_t>(cur.next);
      const Sym right = syms[next_pos];
      const auto it = merges.find(pair_key(cur.c, right.c));
      if (it == merges.end() || it->second.new_id != top.new_id) continue;
      cur.c = top.new_id;
      cur.len += right.len;
      cur.next = right.next;
      syms[next_pos].len = 0;
      if (right.next > -1 && static_cast<size_t>(right.next) < syms.size())
        syms[right.next].prev = static_cast<int>(top.pos);
      if (cur.prev >= 0) {
        const Sym& prev = syms[cur.prev];
        if (auto m = merges.find(pair_key(prev.c, cur.c)); m != merges.end())
          queue.push({m->second.rank, static_cast<size_t>(cur.prev), m->second.new_id});
      }
      if (cur.next >= 0 && static_cast<size_t>(cur.next) < syms.size()) {
        if (auto m = merges.find(pair_key(cur.c, syms[cur.next].c)); m != merges.end())
          queue.push({m->second.rank, top.pos, m->second.new_id});
      }
    }
    for (const Sym& s : syms)
      if (s.len != 0) ids.push_back(s.c);
  }

  std::string bytes_of(int32_t id) const {
    const std::string* t = token_of(id);
    if (!t) return {};
    std::string out;
    const ByteMap& bm = byte_map();
    for (size_t i = 0; i < t->size();) {
      size_t bad = 0;
      const size_t n = utf8_seq(*t, i, &bad);
      if (n == 0) return *t;
      const auto it = bm.rev.find(utf8_decode_at(*t, i, n));
      if (it == bm.rev.end()) return *t;  // a character outside the byte map: the token stays as its UTF-8
      out.push_back(static_cast<char>(it->second));
      i += n;
    }
    return out;
  }
};

namespace {

// Appends the pre-tokenizer(s) of `j` to `out`, a Sequence flattened.
void parse_pre_tokenizer(const json& j, const std::string& where, std::vector<PreTokenizer>& out) {
  const std::string type = get_string(j, "type", where);
  if (type == "Sequence") {
    const json& list = at(j, "pretokenizers", where);
    check(list.is_array(), where, ".pretokenizers must be a list");
    for (size_t i = 0; i < list.size(); ++i)
      parse_pre_tokenizer(list[i], where + ".pretokenizers[" + std::to_string(i) + "]", out);
    return;
  }
  PreTokenizer p{PreTokenizer::ByteLevel, nullptr, "", Behavior::Isolated, false, false};
  if (type == "Split") {
    const json& pat = at(j, "pattern", where);
    check(pat.is_object(), where, ".pattern must be {\"Regex\": ...} or {\"String\": ...}");
    if (pat.contains("Regex")) {
      const std::string re = get_string(pat, "Regex", where + ".pattern");
      p.kind = PreTokenizer::SplitRegex;
      p.regex = std::make_shared<Regex>(re, where + ".pattern.Regex");
    } else {
      p.kind = PreTokenizer::SplitString;
      p.literal = get_string(pat, "String", where + ".pattern");
    }
    static const std::map<std::string, Behavior> behaviors = {
        {"Removed", Behavior::Removed}, {"Isolated", Behavior::Isolated},
        {"MergedWithPrevious", Behavior::MergedWithPrevious}, {"MergedWithNext", Behavior::MergedWithNext},
        {"Contiguous", Behavior::Contiguous}};
    const std::string b = get_string(j, "behavior", where);
    const auto it = behaviors.find(b);
    check(it != behaviors.end(), where, ".behavior \"", b, "\" is not one of Removed, Isolated, MergedWithPrevious, ",
          "MergedWithNext, Contiguous");
    p.behavior = it->second;
    p.invert = get_bool(j, "invert", false, where);
  } else if (type == "ByteLevel") {
    p.add_prefix_space = get_bool(j, "add_prefix_space", true, where);
    if (get_bool(j, "use_regex", true, where)) p.regex = std::make_shared<Regex>(kGpt2Regex, "the GPT-2 regex");
  } else {
    fail(where, ".type \"", type, "\" is not supported (Split, ByteLevel or a Sequence of them)");
  }
  out.push_back(std::move(p));
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  check(f.good(), "cannot open ", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  check(!f.bad(), "cannot read ", path);
  return parse(ss.str(), path);
}

Tokenizer Tokenizer::parse(const std::string& text, const std::string& what) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail(what, ": not valid JSON: ", e.what());
  }
  try {
    auto impl = std::make_unique<Impl>();
    Impl& t = *impl;
    t.what = what;
    check(j.is_object(), what, ": the top level must be an object");

    if (auto n = j.find("normalizer"); n != j.end() && !n->is_null())
      fail(what, ": normalizer ", n->is_object() && n->contains("type") ? n->at("type").dump() : n->dump(),
           " is not supported (only null)");

    // Model.
    const json& model = at(j, "model", what);
    const std::string mw = what + ": model";
    if (model.contains("type")) {
      const std::string type = get_string(model, "type", mw);
      check(type == "BPE", mw, ".type \"", type, "\" is not supported (only BPE)");
    }
    if (auto d = model.find("dropout"); d != model.end() && !d->is_null())
      check(d->is_number() && d->get<double>() == 0.0, mw, ".dropout is not supported (it makes encoding random)");
    for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (auto v = model.find(k); v != model.end() && !v->is_null())
        check(v->is_string() && v->get<std::string>().empty(), mw, ".", k, " is not supported");
    t.fuse_unk = get_bool(model, "fuse_unk", false, mw);
    t.byte_fallback = get_bool(model, "byte_fallback", false, mw);
    t.ignore_merges = get_bool(model, "ignore_merges", false, mw);
    const json& vocab = at(model, "vocab", mw);
    check(vocab.is_object(), mw, ".vocab must be an object of token → id");
    int64_t model_size = 0;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      check(it->is_number_integer() && it->get<int64_t>() >= 0 && it->get<int64_t>() < INT32_MAX, mw, ".vocab[",
            json(it.key()).dump(), "] must be a non-negative integer id");
      const auto id = static_cast<int32_t>(it->get<int64_t>());
      t.vocab[it.key()] = id;
      t.vocab_r[id] = it.key();
    }
    model_size = static_cast<int64_t>(t.vocab.size());  // HF's get_vocab_size: the number of entries
    if (auto u = model.find("unk_token"); u != model.end() && !u->is_null()) {
      check(u->is_string(), mw, ".unk_token must be a string or null");
      t.unk_token = u->get<std::string>();
      check(t.vocab.count(*t.unk_token), mw, ".unk_token ", u->dump(), " is not in the vocabulary");
    }
    const json& merges = at(model, "merges", mw);
    check(merges.is_array(), mw, ".merges must be a list");
    for (size_t r = 0; r < merges.size(); ++r) {
      const json& m = merges[r];
      std::string a, b;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t sp = s.find(' ');
        check(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos, mw, ".merges[", r, "] ",
              m.dump(), " is not two tokens separated by one space");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else {
        check(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(), mw, ".merges[", r,
              "] must be \"a b\" or [\"a\", \"b\"]");
        a = m[0].get<std::string>();
        b = m[1].get<std::string>();
      }
      const auto ia = t.vocab.find(a), ib = t.vocab.find(b), in = t.vocab.find(a + b);
      check(ia != t.vocab.end(), mw, ".merges[", r, "]: ", json(a).dump(), " is not in the vocabulary");
      check(ib != t.vocab.end(), mw, ".merges[", r, "]: ", json(b).dump(), " is not in the vocabulary");
      check(in != t.vocab.end(), mw, ".merges[", r, "]: ", json(a + b).dump(), " is not in the vocabulary");
      t.merges[pair_key(ia->second, ib->second)] = Merge{static_cast<uint32_t>(r), in->second};
    }

    // Added tokens: ids as HF's AddedVocabulary::add_tokens gives them (the model's id when the content is in the
    // vocabulary, else the next free one), special ones matched first.
    std::vector<AddedToken> specials, others;
    if (auto a = j.find("added_tokens"); a != j.end() && !a->is_null()) {
      check(a->is_array(), what, ": added_tokens must be a list");
      for (size_t i = 0; i < a->size(); ++i) {
        const std::string w = what + ": added_tokens[" + std::to_string(i) + "]";
        const json& e = (*a)[i];
        AddedToken tok;
        tok.content = get_string(e, "content", w);
        const json& id = at(e, "id", w);
        check(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < INT32_MAX, w,
              ".id must be a non-negative integer");
        tok.id = static_cast<int32_t>(id.get<int64_t>());
        tok.single_word = get_bool(e, "single_word", false, w);
        tok.lstrip = get_bool(e, "lstrip", false, w);
        tok.rstrip = get_bool(e, "rstrip", false, w);
        tok.special = get_bool(e, "special", false, w);
        tok.normalized = get_bool(e, "normalized", !tok.special, w);
        if (tok.content.empty()) continue;
        if (tok.special) t.special_set.insert(tok.content);
        if (auto known = t.id_of(tok.content)) {
          tok.id = *known;
        } else {
          int64_t max_id = -1;
          for (const auto& [c, v] : t.added_map) max_id = std::max<int64_t>(max_id, v);
          const bool after_added = max_id >= 0 && (max_id >= model_size || model_size == 0);
          tok.id = static_cast<int32_t>(after_added ? max_id + 1 : model_size);
        }
        t.added_map[tok.content] = tok.id;
        auto same = [&](const AddedToken& x) { return x.content == tok.content; };
        const bool dup = std::any_of(specials.begin(), specials.end(), same) ||
                         std::any_of(others.begin(), others.end(), same);
        if (!dup) (tok.special ? specials : others).push_back(tok);
      }
    }
    t.added = specials;
    t.added.insert(t.added.end(), others.begin(), others.end());
    for (size_t i = 0; i < t.added.size(); ++i) {
      t.added_by_id[t.added[i].id] = i;
      t.by_first_byte[static_cast<unsigned char>(t.added[i].content[0])].push_back(i);
    }

    // Pre-tokenizer.
    if (auto p = j.find("pre_tokenizer"); p != j.end() && !p->is_null()) {
      parse_pre_tokenizer(*p, what + ": pre_tokenizer", t.pre);
    }
    // Decoder: ByteLevel (or a Sequence holding only ByteLevel).
    const json& dec = at(j, "decoder", what);
    check(dec.is_object(), what, ": decoder must be a ByteLevel decoder (null is not supported)");
    std::string dtype = get_string(dec, "type", what + ": decoder");
    if (dtype == "Sequence") {
      const json& list = at(dec, "decoders", what + ": decoder");
      check(list.is_array() && list.size() == 1 && list[0].is_object(), what,
            ": decoder Sequence must hold exactly one ByteLevel decoder");
      dtype = get_string(list[0], "type", what + ": decoder.decoders[0]");
    }
    check(dtype == "ByteLevel", what, ": decoder type \"", dtype, "\" is not supported (only ByteLevel)");
    // Post-processor: ByteLevel only changes offsets; a template would add ids, which GLM does not use.
    if (auto pp = j.find("post_processor"); pp != j.end() && !pp->is_null()) {
      const std::string ptype = get_string(*pp, "type", what + ": post_processor");
      check(ptype == "ByteLevel", what, ": post_processor type \"", ptype, "\" is not supported (only ByteLevel)");
    }

    int64_t size = 0;
    for (const auto& [tok, id] : t.vocab) size = std::max<int64_t>(size, id + 1);
    for (const auto& [tok, id] : t.added_map) size = std::max<int64_t>(size, id + 1);
    t.size = size;
    return Tokenizer(std::move(impl));
  } catch (const json::exception& e) {
    fail(what, ": malformed tokenizer.json: ", e.what());
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  decode_utf8(text, "the text to encode");  // validates
  std::vector<int32_t> ids;
  for (const auto& [tok, s, e] : impl_->segments(text)) {
    if (tok >= 0) {
      ids.push_back(impl_->added[tok].id);
      continue;
    }
    for (const std::string& piece : impl_->pre_tokenize(std::string(text.substr(s, e - s)))) impl_->bpe(piece, ids);
  }
  return ids;
}

std::vector<std::string> Tokenizer::pre_tokenize(std::string_view text) const {
  decode_utf8(text, "the text to pre-tokenize");
  return impl_->pre_tokenize(std::string(text));
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids) {
    const std::string* t = impl_->token_of(id);
    if (!t || (skip_special_tokens && impl_->special_set.count(*t))) continue;
    bytes += impl_->bytes_of(id);
  }
  return utf8_lossy(bytes);
}

std::string Tokenizer::token_bytes(int32_t id) const { return impl_->bytes_of(id); }
int64_t Tokenizer::vocab_size() const { return impl_->size; }
std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const { return impl_->id_of(token); }
bool Tokenizer::is_special(int32_t id) const {
  const std::string* t = impl_->token_of(id);
  return t && impl_->special_set.count(*t);
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t bad = 0;
    const size_t n = utf8_seq(s, i, &bad);
    if (n) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += bad;
    }
  }
  return out;
}

}  // namespace nextlm
