"""Function calling (OpenAI `tools` / `tool_choice` on chat completions).

formats.py   how each model family writes calls; the --tool-call-parser registry
json_scan.py where JSON values end in growing text
stream.py    output text -> normal text + tool calls, incrementally (streaming) or at once
tool_choice.py  request validation, what the chat template gets, the grammar that forces calls
"""
