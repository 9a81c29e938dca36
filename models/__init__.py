"""Model definitions selectable from conf/model/."""
