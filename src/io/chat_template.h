// GLM's chat format for text messages, rendered as GLM-4.5's jinja chat template renders it (the template that
// tests/golden/make_tokenizer_goldens.py puts in tokenizer_config.json; transformers' apply_chat_template output is
// the golden). The model's own template cannot be run (there is no jinja here); this is its text-message subset:
//
//   [gMASK]<sop>                                   once, first
//   <|system|>\n{content}                          a system message
//   <|user|>\n{content}                            a user message (+ "/nothink" when enable_thinking is false and
//                                                  the content does not already end with it)
//   <|assistant|>\n<think>{reasoning}</think>      an assistant message after the last user message whose content
//                                                  holds "...</think>" (reasoning: the text before </think>, after
//                                                  any <think>, stripped); otherwise "<|assistant|>\n<think></think>"
//   \n{answer}                                     then, if the answer (the text after </think>, or all of it) is not
//                                                  blank: the answer, stripped of surrounding whitespace
//   <|observation|>\n<tool_response>\n{content}\n</tool_response>
//                                                  a tool message (<|observation|> only for the first of a run)
//   <|assistant|>                                  the generation prompt (no newline after it; the model writes
//                                                  what follows), + "\n<think></think>" when enable_thinking is false
//
// Nothing separates messages: each starts with its role token. "Stripped" is Python's str.strip().
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace nextlm {

struct ChatMessage {
  std::string role;  // system, user, assistant or tool
  std::string content;
};

struct ChatOptions {
  bool add_generation_prompt = true;
  std::optional<bool> enable_thinking;  // unset: the template's default (thinking on, nothing added)
};

// The prompt text (encode it with the model's Tokenizer: the role tokens are its special tokens). Throws Error for
// a role other than system, user, assistant or tool.
std::string render_glm_chat(const std::vector<ChatMessage>& messages, const ChatOptions& options = {});

}  // namespace nextlm
