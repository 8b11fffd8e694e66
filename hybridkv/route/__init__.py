"""`hybridkv route`: an OpenAI-compatible proxy over N engines that routes by the index's joint hit."""
