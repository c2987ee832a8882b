"""What stages read: text rows (text.py), datasets from where users keep them (sources/), and chat rows with
images and their image parts (image_chat.py, image_parts.py, image_examples.py)."""
