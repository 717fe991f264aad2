"""Local web chat with a live view of KVarN KV-cache memory (python -m apps.chat)."""
