"""The caller protocols at the HTTP surface (design §14): a `CallerProtocol` object each
(chat, Messages, Responses), the registry that finds one by path or name, and compaction."""
