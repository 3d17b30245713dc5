"""Advanced lesson 16: tool calling (the tools prompt, <tool_call> parsing, tool_choice, the server)."""
