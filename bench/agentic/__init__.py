"""The agentic benchmark: coding-agent sessions (long shared prefixes, growing contexts, tool and human
pauses, compaction, sub-agents) replayed closed within a session and open across sessions."""
