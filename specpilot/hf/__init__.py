"""Hugging Face model directories: the one parser of config.json (`config`), the one reader of
checkpoints (`checkpoint`), and released models' configs priced without their weights (`known`)."""
