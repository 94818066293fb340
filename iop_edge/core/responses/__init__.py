"""What the Edge reads and keeps of Anthropic Messages and OpenAI Responses requests,
pure: request views, `previous_response_id` chains, compaction, unstored replies (design §14)."""
