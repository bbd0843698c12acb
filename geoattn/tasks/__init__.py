"""geoattn.tasks"""
