"""What a run does with a loaded model: loading a converted checkpoint (checkpoint.py), the generate loop
with its prefill and decode step (generation.py), prompt and completion handling (prompts.py), teacher-forced
scoring and block capture (scoring.py), and DSpark speculative decoding (speculative.py). The model modules
never import from here; generate.py and the tools do."""
