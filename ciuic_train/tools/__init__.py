"""Commands that work on a finished run or sweep: the ablation report (`ciuic-train-report`)
and the export to Hugging Face's layout (`ciuic-train-export`)."""
